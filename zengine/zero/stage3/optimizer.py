"""The stage-3 optimizer: parameters sharded too, gathered by module hooks.

The boundary step is ``ZeroOptimizer.step`` unchanged; what stage 3 adds is
who holds the parameters (``ShardedParam``), how gradients reach the shards
(``grads.stage3_gradients``), the hooks and fetcher that make parameters whole
only while a module runs, and the fetcher's gather check, which joins the
step's agreement as a participant (``GatherAgreement``). ``build.py``
assembles it; where the shards live (device, host memory, an NVMe swap
file) is the placement's business (``offload/placement.py``), asked through
``placement.params``.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ...distributed import agreement, collectives
from ..optimizer import ZeroOptimizer
from ..step_stats import StepStats
from .blocks import BlockOf, block_names
from .fetcher import Fetcher
from .grads import ExternalUseError
from .group import ShardedParamGroup
from .hooks import ModuleHooks
from .param import ParamState, ShardedParam
from .parameter_offload import ParameterOffload

# autograd's check of a gradient against the shape its op saw: "... got [0] but expected shape compatible with [a, b]"
_EMPTY_GRADIENT = re.compile(
    r"returned an invalid gradient at index \d+ - got \[0\] but expected shape compatible "
    r"with \[([\d, ]*)\]"
)


@dataclass
class ShardedModel:
    """The module's parameters as stage 3 holds them: every parameter sharded (``all_sharded``), the
    trainable ones in the optimizer's groups and the rest in ``frozen``, gathered by ``fetcher``."""

    module: nn.Module
    fetcher: Fetcher
    all_sharded: list[ShardedParam]
    frozen: ShardedParamGroup


class GatherAgreement:
    """Stage 3 in the boundary step (a ``zero/optimizer.StepParticipant``): the digest of the
    gathers each rank issued since the last boundary rides on the step's all-reduce
    (``fetch_check.FetchCheck``); ranks that gathered differently are named before anything is updated
    (``on_diverged`` first)."""

    def __init__(self, fetcher: Fetcher, on_diverged: Callable[[], None]):
        self.fetcher = fetcher
        self.on_diverged = on_diverged

    def agreement_values(self) -> tuple[tuple[int, int], Optional[torch.Tensor]]:
        d1, d2, bad = self.fetcher.boundary_values()
        return (d1, d2), bad

    def agreed(self, stats: StepStats) -> None:
        if not stats.fetches_agree:  # the ranks gathered different parameters (nothing updated yet)
            self.on_diverged()
            self.fetcher.raise_diverged()
        self.fetcher.check.reset()  # the next comparison starts here

    def before_update(self) -> None:
        # offload_param: CPU-Adam writes the shards the gathers uploaded from
        self.fetcher.host_reads_done()


class Stage3Optimizer(ZeroOptimizer):
    """ZeroOptimizer over stage-3 groups, with the hooks that gather parameters on demand (built by
    ``stage3/build.py``)."""

    def __init__(
        self, model: ShardedModel, groups: list[ShardedParamGroup], grads, *args, **kwargs
    ):
        self.module = model.module
        self.fetcher = model.fetcher
        self.all_sharded = model.all_sharded
        self.frozen = model.frozen
        agreement = GatherAgreement(self.fetcher, self.zero_grad)
        super().__init__(groups, grads, *args, participant=agreement, **kwargs)
        for sp in (
            self.all_sharded
        ):  # GatheredParameters gathers through the optimizer that holds the parameter
            sp.owner = self
        self.param_swap = (
            self.placement.params.swap
        )  # the parameter swap file, with offload_param nvme
        self.module_hooks = ModuleHooks(self.module, self.fetcher)
        # stage3_gather_units "auto": a gather group never spans two of the model's blocks
        self.fetcher.trace.block_of = BlockOf(block_names(self.module))
        self.module_hooks.gather_before_gradient([sp for g in groups for sp in g.sharded])
        # DeepSpeed's DeepSpeedZeRoOffload members (TRL's generation takes the hooks off and back)
        self.parameter_offload = ParameterOffload(self.module, self.module_hooks, self.fetcher)
        # (torch marks the hook object itself, which a bound method cannot take: a plain function)
        self._state_dict_hook = self.module.register_state_dict_post_hook(
            lambda module, state_dict, prefix, local_metadata: self._on_state_dict(
                state_dict, prefix
            )
        )

    # -- forward and backward -------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self):
        # nothing to train (an engine without an optimizer): no step follows, so no forward is a training one
        training = torch.is_grad_enabled() and self.module.training and bool(self.groups)
        self.fetcher.begin_step(training)
        with self.module_hooks.mode():
            yield
        self.fetcher.end_forward(
            training
        )  # outside training no step checks the gathers: check them here

    def explain_backward_error(self, error: RuntimeError) -> BaseException:
        """Autograd refuses the empty gradient of a partitioned parameter that an op outside the forward used
        (a regulariser over engine.module.parameters()) while the forward used it gathered: name it."""
        found = _EMPTY_GRADIENT.search(str(error))
        if found is None:
            return error
        shape = tuple(int(d) for d in found.group(1).split(",") if d.strip())
        names = [sp.name for sp in self.all_sharded if tuple(sp.shape) == shape]
        return ExternalUseError(
            f"stage 3: a parameter of shape {list(shape)} ({', '.join(names) or 'unknown'}) was used outside the "
            f"engine's forward (e.g. a regulariser over engine.module.parameters() added to the loss), where a "
            f"partitioned parameter is an empty tensor, so its gradient is empty. Compute the term inside the "
            f"model's forward: zengine gathers a parameter used there, also outside its own module"
        )

    def end_backward(self) -> None:
        super().end_backward()
        self.release_all()
        self.fetcher.end_step()
        self.module_hooks.backward_done()

    def close(self) -> None:
        self.fetcher.drain()  # reads ahead finish before the placement closes the parameter swap file
        super().close()
        self.module_hooks.close()
        self._state_dict_hook.remove()

    def _on_state_dict(self, state_dict: dict, prefix: str) -> None:
        """``engine.module.state_dict()`` outside a gather would hold the partitioned parameters'
        empty tensors (a file saved from it cannot be loaded): put their whole values in instead,
        gathered, as torch's model would return them. A collective: every rank calls
        ``state_dict()`` (one rank alone is named by the agreement, ``summon_full_params``)."""
        if not any(sp.state is ParamState.SHARDED for sp in self.all_sharded):
            return  # inside a gather, or nothing partitioned: the values are there
        sharded = {id(sp.param) for sp in self.all_sharded}
        with self.summon(writeback=False):
            for name, p in self.module.named_parameters(remove_duplicate=False):
                key = prefix + name
                if id(p) in sharded and key in state_dict:
                    state_dict[key] = p.detach().clone()  # (the gathered storage goes at the exit)

    def release_all(self) -> None:
        """Free every gathered parameter that is not persistent or held by a context."""
        self.fetcher.release(
            [sp for sp in self.all_sharded if sp.state is ParamState.GATHERED], force=True
        )

    # -- full parameters on request -------------------------------------------------------------
    def sync_masters(self) -> None:
        """Copy the compute-dtype shards into separate fp32 masters (after shards were written)."""
        with torch.no_grad(), self.states_resident():
            for g, master in zip(self.groups, self.masters):
                self.placement.params.load(g, master)

    def refresh_param(self, gi: int, pi: int, value: torch.Tensor) -> None:
        """After ``safe_set_full_fp32_param`` (the shard is already written): a parameter that stays
        gathered shows ``value`` too."""
        g = self.groups[gi]
        sp = g.sharded[pi]
        self.placement.params.write_param(
            g, pi, self.masters[gi]
        )  # an NVMe shard from the master just set
        if sp.state is ParamState.GATHERED:
            with torch.no_grad():
                sp.full.narrow(0, 0, sp.numel).copy_(value.reshape(-1))

    @contextlib.contextmanager
    def full_params(
        self,
        params: Sequence[ShardedParam],
        modifier_rank=None,
        writeback: bool = False,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
    ):
        """Gather ``params`` whole for the duration; see Engine.summon_full_params and zero.GatheredParameters."""
        params = list(params)
        # Our own gathering, even when the caller is inside a forward (GatheredParameters around a tied head, as
        # TRL's fused loss does): the external-use mode must not take our parameter swaps for a user's reads.
        with self.module_hooks.own_work():
            self.fetcher.gather_now([sp for sp in params if sp.state is ParamState.GATHERED])
            self.fetcher.fetch(
                [sp for sp in params if sp.state is ParamState.SHARDED],
                "gathered parameters",
                exact=True,
            )
        for sp in params:
            sp.pinned = True
        saved = {}
        if offload_to_cpu or rank0_only:
            for sp in params:
                saved[id(sp)] = sp.param.data
                keep = (not rank0_only) or self.dp_rank == 0
                sp.param.data = (
                    (sp.param.data.to("cpu", copy=True) if offload_to_cpu else sp.param.data)
                    if keep
                    else torch.empty(0, dtype=sp.full.dtype, device=sp.full.device)
                )
        try:
            yield
        finally:
            with self.module_hooks.own_work():
                self._end_full_params(
                    params, saved, modifier_rank, writeback, rank0_only, offload_to_cpu
                )

    def _end_full_params(
        self, params, saved, modifier_rank, writeback, rank0_only, offload_to_cpu
    ) -> None:
        """Leave full_params: restore what the caller saw, write modifications back, release."""
        if saved:
            for sp in params:
                view = saved[id(sp)]
                if writeback and (not rank0_only or self.dp_rank == 0) and offload_to_cpu:
                    view.copy_(sp.param.data)
                sp.param.data = view
        # over every data-parallel rank (all hold the gathered parameter): with MiCS the shard groups' copies too
        if modifier_rank is not None:
            for sp in params:
                collectives.broadcast(sp.full, modifier_rank, self.dp_group)
        if modifier_rank is not None or writeback:
            if rank0_only and writeback and modifier_rank is None:
                for sp in params:
                    collectives.broadcast(sp.full, 0, self.dp_group)
            for sp in params:
                sp.write_back_full()
            self.sync_masters()
        for sp in params:
            sp.pinned = False
        self.fetcher.release(params, force=True)
        self.fetcher.drop_staging()

    @contextlib.contextmanager
    def summon(
        self,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ):
        with (
            agreement.collective_call("summon_full_params", self.dp_group),
            self.full_params(
                self.all_sharded,
                writeback=writeback,
                rank0_only=rank0_only,
                offload_to_cpu=offload_to_cpu,
            ),
        ):
            if with_grads:
                self._gather_grads()
            try:
                yield
            finally:
                if with_grads:
                    for g in self.groups:
                        for p in g.params:
                            p.grad = None

    def _gather_grads(self) -> None:
        """Give every trainable parameter its whole reduced gradient (the mean over ranks, unscaled)."""
        factor = self.grad_factor.unscale()
        for gi, g in enumerate(self.groups):
            shard = self.grads.owned_grad(gi)
            for sp, off in zip(g.sharded, g.offsets):
                # [world, chunk] on the compute device: with optimizer offload the shard is on the host,
                # and NCCL gathers only device tensors
                staging = torch.empty(self.world, sp.chunk, dtype=shard.dtype, device=self.device)
                staging[self.rank].copy_(shard[off : off + sp.chunk])
                collectives.all_gather_rows(staging, self.rank, self.comm_group)
                sp.param.grad = (
                    (staging.view(-1)[: sp.numel] * factor).view(sp.shape).to(sp.full.dtype)
                )

    def memory_tensors(self):
        kinds = super().memory_tensors()
        kinds["parameters"] = (
            kinds["parameters"] + self.frozen.tensors() + self.placement.params.host_buffers()
        )
        return kinds
