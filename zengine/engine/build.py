"""What the engine builds at start, from the model, the config and the script's arguments: the
matmul routing, the param groups, and the optimizer, scheduler and data loader factories
(DeepSpeed's rules for client objects versus config sections). Where the model starts (device,
dtype, rank 0's values, stage 3's cut) is ``zero/place.py``'s."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..config import ZengineConfig
from ..config.precision import DTYPES
from ..distributed.process_group import ProcessRank
from ..optim import build_optimizer, build_scheduler
from ..precision.autocast import ForwardPrecision, forward_precision
from ..optim.builder import Bf16Masters
from ..precision.masters import MasterPrecision
from ..precision.cpu_matmul import MatmulPolicy, choose_matmul_policy, log_choice
from ..precision.grad_factor import GradFactor
from ..precision.loss_scaler import LossScaler
from ..zero.grad_dtypes import ReduceScaling
from ..zero.optimizer import ShardGroup

logger = logging.getLogger("zengine")


def route_matmuls(
    model: nn.Module, config: ZengineConfig, process_rank: ProcessRank
) -> MatmulPolicy:
    """Choose where the model's bf16 matrix multiplies run on this CPU (``bf16.cpu_matmul``; any other
    device or dtype is left alone), apply it to the model and say so once on rank 0."""
    policy = choose_matmul_policy(config.bf16.cpu_matmul, config.compute_dtype, process_rank.device)
    routed = policy.apply(model)
    if process_rank.rank == 0:
        log_choice(policy, routed)
    return policy


def buffer_dtype(config: ZengineConfig) -> Optional[torch.dtype]:
    """``data_types.buffer_dtype`` as a dtype (None: the compute dtype)."""
    name = config.data_types.buffer_dtype
    return DTYPES[name] if name is not None else None


def precision_parts(
    config: ZengineConfig, ranks: ShardGroup
) -> tuple[ForwardPrecision, LossScaler, GradFactor]:
    """The forward's precision (on the parameters' dtype, or under torch.autocast), the loss scaler
    and the gradient factor (grad_factor.py: what gradients are multiplied by on the way and
    divided by at the step; its world is 1 where the reduction takes the mean:
    ``gradient_predivide_factor``, ``prescale_gradients``)."""
    stage = config.zero_optimization.stage
    precision = forward_precision(config.torch_autocast, ranks.device, stage)
    scaler = precision.loss_scaler(config.fp16)
    world = ReduceScaling.from_config(config, ranks.dp_world).world_at_step(ranks.dp_world)
    factor = GradFactor.for_precision(
        scaler, config.fp16, config.gradient_accumulation_steps, world
    )
    return precision, scaler, factor


def named_param_groups(
    model: nn.Module, model_parameters, client_optimizer, training: "Training"
) -> list:
    """(name, parameter) pairs and hyper-parameters of each param group; frozen and repeated ones left
    out. None without an optimizer: the engine trains nothing (as DeepSpeed, it ignores
    ``model_parameters`` then; Lightning passes ``[]``)."""
    if not training.has_optimizer:
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    if isinstance(client_optimizer, torch.optim.Optimizer):
        raw = client_optimizer.param_groups
    elif model_parameters is None:
        raw = [{"params": list(model.parameters())}]
    else:
        items = list(model_parameters)
        raw = items if items and isinstance(items[0], dict) else [{"params": items}]
    groups, seen = [], set()
    for group in raw:
        params = group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        named = []
        for p in params:
            if id(p) not in names:
                raise ValueError(
                    "zengine.initialize: model_parameters holds a tensor that is not a parameter of "
                    "the model; pass model.parameters() or param groups built from them"
                )
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((names[id(p)], p))
        groups.append((named, {k: v for k, v in group.items() if k != "params"}))
    if not any(named for named, _ in groups):
        raise ValueError(
            "zengine.initialize: model_parameters (or the optimizer's param groups) hold no parameter "
            "that requires grad; there is nothing to train. Pass the trainable parameters"
        )
    return groups


class NoOptimizerError(RuntimeError):
    """``engine.backward`` or ``engine.step`` on an engine built without an optimizer (no
    ``optimizer=`` and no ``"optimizer"`` section: a reference model, inference, evaluation)."""


class Training:
    """Whether the engine trains, chosen once at ``initialize``: with an optimizer (``optimizer=``
    or the config's ``"optimizer"`` section) it runs backward and step; without one it is an engine
    for forward only (DeepSpeed builds such an engine too: TRL's reference model, Lightning's
    ``validate``/``test``/``predict`` and Fabric's ``setup_module``), which keeps the model placed
    and sharded as the config says, saves and loads it, and refuses backward and step by name."""

    def __init__(self, has_optimizer: bool):
        self.has_optimizer = has_optimizer

    @classmethod
    def of(cls, client_optimizer, config: ZengineConfig) -> "Training":
        """The engine trains when the script passes an optimizer or the config names one."""
        return cls(client_optimizer is not None or config.optimizer is not None)

    def require(self, what: str) -> None:
        """Raise ``NoOptimizerError`` naming ``engine.<what>()`` when there is no optimizer."""
        if not self.has_optimizer:
            raise NoOptimizerError(
                f"engine.{what}(): this engine was built without an optimizer (zengine.initialize had "
                "no optimizer= and the config no \"optimizer\" section), so it runs forward, eval(), "
                "save and load only. To train, pass optimizer= (a torch.optim.Optimizer or a "
                "callable(params)) or add an \"optimizer\" section to the config"
            )


class NoOptimizer(torch.optim.Optimizer):
    """The wrapped optimizer of an engine without one: no param groups, no state. ``step`` raises
    (the engine refuses earlier, by name: ``Training.require``)."""

    def __init__(self):
        super().__init__([{"params": []}], {})  # (torch refuses an empty list of parameters)
        self.param_groups.clear()

    def step(self, closure=None):
        """Refused: there is nothing to step."""
        Training(False).require("step")


def bf16_masters(config: ZengineConfig, seed: int) -> Bf16Masters | None:
    """How the optimizer steps bf16 or fp16 masters (``*.*_master_weights_and_grads``), or None
    for fp32 masters; ``seed``: stochastic rounding's, one per rank."""
    precision = MasterPrecision.from_config(config)
    if not precision.low:
        return None
    fp32_states = precision.states == torch.float32
    return Bf16Masters(fp32_states, precision.rounding.value, seed, precision.dtype)


def optimizer_factory(client_optimizer, config: ZengineConfig, seed: int = 0):
    """A function (flat shard param groups, cpu_offload) -> the wrapped torch optimizer.
    ``seed``: stochastic rounding's (bf16 masters), distinct per rank."""
    masters = bf16_masters(config, seed)
    if client_optimizer is not None and masters is not None:
        from ..ops import CPUAdam  # a script's CPUAdam honours fp32 moments over bf16 masters

        states_ok = isinstance(client_optimizer, CPUAdam)
        problem = (
            None
            if states_ok and masters.rounding == "nearest"
            else masters.refusal("the script's optimizer")
        )
        if problem:
            raise ValueError(problem)
    if isinstance(client_optimizer, torch.optim.Optimizer):

        def rebind(groups, cpu_offload=False):
            # Keep the caller's optimizer object (and any scheduler built on it): point its groups at the shards.
            for mine, theirs in zip(groups, client_optimizer.param_groups):
                theirs["params"] = mine["params"]
            client_optimizer.state.clear()
            return client_optimizer

        return rebind
    if client_optimizer is not None:
        if not callable(client_optimizer):
            raise TypeError(
                "zengine.initialize: optimizer must be a torch.optim.Optimizer or a callable(params)"
            )
        return lambda groups, cpu_offload=False: client_optimizer(groups)
    if config.optimizer is None:  # an engine for forward only (Trainings.NONE)
        return lambda groups, cpu_offload=False: NoOptimizer()
    return lambda groups, cpu_offload=False: build_optimizer(
        config.optimizer.type,
        config.optimizer.params,
        groups,
        cpu_offload=cpu_offload,
        bf16_masters=masters,
    )


def make_scheduler(lr_scheduler, config: ZengineConfig, optimizer, training: "Training"):
    """The LR schedule: the script's (an object, or a callable given the wrapped torch optimizer), else
    the config's section, else None. Without an optimizer there is nothing to schedule: None, and a
    schedule given is named in a warning (DeepSpeed ignores it silently)."""
    if not training.has_optimizer:
        if lr_scheduler is not None or config.scheduler is not None:
            logger.warning(
                "zengine.initialize: no optimizer, so the LR scheduler given (lr_scheduler= or the "
                "config's \"scheduler\" section) is not used"
            )
        return None
    if lr_scheduler is not None:
        # A callable gets the wrapped torch optimizer (as in DeepSpeed), so torch's own schedulers work.
        return lr_scheduler if hasattr(lr_scheduler, "step") else lr_scheduler(optimizer.optimizer)
    if config.scheduler is not None:
        return build_scheduler(config.scheduler.type, config.scheduler.params, optimizer)
    return None


def make_dataloader(data, config: ZengineConfig, process_rank: ProcessRank, collate_fn):
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(data, num_replicas=process_rank.world_size, rank=process_rank.rank)
    return DataLoader(
        data,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=True,
    )


class UnfrozenParameterError(RuntimeError):
    """A parameter frozen at ``initialize`` requires grad now: the engine has no gradient store, master
    or optimizer state for it, so training on would leave it untrained while the script expects it to
    learn (progressive unfreezing). Raised at ``engine.step()``, before any update."""


class UntrainedParameters:
    """The model's parameters the engine does not train (frozen, or left out of model_parameters, at
    initialize). ``check`` (at every ``engine.step()``; one flag read per such parameter) stops the run by
    name when one frozen at initialize has been unfrozen since, and names once, as a warning, one left out
    of model_parameters that required grad all along (the script chose not to train it)."""

    def __init__(self, model: nn.Module, named_groups: list):
        trained = {id(p) for named, _ in named_groups for _, p in named}
        self.model = model
        self.params = [(n, p) for n, p in model.named_parameters() if id(p) not in trained]
        self.frozen = {id(p) for _, p in self.params if not p.requires_grad}  # at initialize
        self.known = {id(p) for p in model.parameters()}  # every parameter at initialize
        self.named: set[str] = set()

    def check(self) -> None:
        """Raise ``UnfrozenParameterError`` for parameters unfrozen since initialize; warn once about
        parameters left out of model_parameters that require grad."""
        unfrozen = [n for n, p in self.params if p.requires_grad and id(p) in self.frozen]
        if unfrozen:
            raise UnfrozenParameterError(
                f"zengine: parameter(s) {', '.join(unfrozen)} were frozen at zengine.initialize and require "
                "grad now; the engine holds no gradient, master or optimizer state for them and would not "
                "train them. Unfreeze before initialize (a zero learning rate in their param group keeps "
                "them still until then), or save_checkpoint, build a new engine over the unfrozen model "
                "and load_checkpoint(..., load_optimizer_states=False)"
            )
        added = [
            n
            for n, p in self.model.named_parameters()
            if id(p) not in self.known and p.requires_grad
        ]
        if added:  # add_module / register_parameter / an assigned nn.Parameter after initialize
            raise UnfrozenParameterError(
                f"zengine: parameter(s) {', '.join(added[:8])}{' ...' if len(added) > 8 else ''} "
                "were added to engine.module after zengine.initialize and require grad; the engine "
                "holds no gradient, master or optimizer state for them and would not train them "
                "(torch's optimizer would not either, unless given them). Nothing was updated. Add "
                "them before initialize (requires_grad=False or a zero learning rate keeps them "
                "still until their time), or save_checkpoint, build a new engine over the grown "
                "model and load_checkpoint(..., load_module_strict=False)"
            )
        late = [n for n, p in self.params if p.requires_grad and n not in self.named]
        if late:
            self.named.update(late)
            logger.warning(
                "zengine: parameter(s) %s require grad but were left out of model_parameters at "
                "zengine.initialize, so the engine does not train them (no gradient reduction, no "
                "optimizer step); pass them in model_parameters to train them",
                ", ".join(late),
            )
