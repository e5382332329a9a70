"""The ZeRO optimizer for stages 0-2: master weights, the boundary step, write-back.

A stage is a composition, chosen once:

    stage 0: replicated master (num_shards = 1) + FullGradients
    stage 1: sharded master    (num_shards = W) + FullGradients
    stage 2: sharded master    (num_shards = W) + ShardedGradients

Every stage runs the same boundary step (``ZeroOptimizer.step``):

1. finish the reduction (``grads.end_backward`` already waited on it);
2. build each group's fp32 master gradient from the summed gradient, times
   ``1 / (world * loss_scale)`` (one pass; a view, no copy, in fp32);
3. one all-reduce of the step's control values (``step_stats.py``: sum of
   squares over this rank's part, whether it ran a backward, its micro-step
   count, used flags) on the compute device, read on the host once: the
   global norm before clipping, overflow, ranks out of step, and which
   parameters got a gradient on any rank;
4. when the norm is not finite, skip (``nonfinite.py``); else clip, step
   the wrapped torch optimizer on the flat master shards (a parameter no rank
   gave a gradient is not stepped and keeps its own step count, as in torch:
   ``step_counts.py``), write the master back into
   the compute-dtype parameters and gather them in buckets of
   ``allgather_bucket_size``.

The wrapped optimizer is any ``torch.optim.Optimizer``; it sees one flat
fp32 parameter per group, so its state is sharded with the master. What it
can do beyond that (step ranges with their own step numbers, write the
parameters while stepping, hold its states in a swap file) it declares
(``ops/shard_optimizer.py``).

Where the states live (device, host memory, NVMe) is not a branch here: the
``placement`` and the master store (``masters.py``) that ``stages.py``
chooses differ, and the step calls them. With the optimizer on the host of a
device with side streams the master store takes step 4 in pieces, overlapped
with the copies of gradients down and parameters up (``masters.py``,
``offload/step_pipeline.py``).
"""
from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..offload.placement import Placement
from ..ops.shard_optimizer import abilities
from ..precision.loss_scaler import LossScaler
from ..runtime.base_optimizer import ZeROOptimizer  # DeepSpeed's base: its state_dict, isinstance
from . import full_state
from .grad_hooks import GradHooks
from .flat_group import FlatParamGroup  # or any group with the same interface (stage 3's)
from .masters import MastersInMemory
from .mics import Replication
from .nonfinite import NonFinitePolicy
from .step_counts import RunStepper, StepCounts
from .step_stats import gather_stats


@dataclass(frozen=True)
class Ranks:
    """This rank in the data-parallel group the optimizer shards over."""

    world: int
    rank: int
    device: torch.device  # the compute device
    group: Any = None     # the process group (None: the default one)
    replication: Replication = Replication()  # MiCS: other ranks hold the same shards (mics.py)

    @property
    def dp_world(self) -> int:
        """Every data-parallel rank: the gradient is the mean over these."""
        return self.world * self.replication.count

    @property
    def dp_rank(self) -> int:
        """This rank among every data-parallel rank (shard groups are consecutive ranks)."""
        return self.replication.index * self.world + self.rank

    @property
    def dp_group(self) -> Any:
        """The group of every data-parallel rank: the step's agreement and checkpoints run over it."""
        return self.group if self.replication.count == 1 else None  # MiCS cuts the default group


def shard_runs(groups: list, shard_params: list, plans: list) -> dict:
    """Shard param -> its (lo, hi, step number) runs, for an optimizer that steps ranges (``step_runs``)."""
    runs = {}
    for g, sp, plan in zip(groups, shard_params, plans):
        if plan.uniform is not None:  # the whole shard, padding included, as one run
            runs[sp] = [(0, g.owned[1] - g.owned[0], plan.uniform + 1)]
        else:
            runs[sp] = [(r.lo, r.hi, r.count + 1) for r in plan.runs]
    return runs


@dataclass(frozen=True)
class StepRules:
    """How the boundary step treats the gradient and publishes the parameters."""

    clip: float                   # gradient_clipping (0: off)
    nonfinite: NonFinitePolicy    # skip, warn or raise on a non-finite gradient
    allgather_bucket_numel: int   # parameters gathered per bucket after the step (stages 1-2)
    accumulation_steps: int = 1   # what the summed gradients are divided by: gradient_accumulation_steps, or
    #                               1 when each loss carries it (fp16: precision/loss_scaler.py)


class StepOutcome(enum.Enum):
    """What a boundary step did."""

    APPLIED = "applied"
    SKIPPED = "skipped"          # the gradient was not finite (nonfinite.py)
    NO_BACKWARD = "no_backward"  # no rank ran a backward since the last step: nothing to do


class ZeroOptimizer(ZeROOptimizer):
    """Owns the flat groups, their fp32 masters, the gradient store and the wrapped optimizer.

    Everything it is made of comes in at construction: the groups and gradient store of its stage,
    the ``placement`` (where states live) and the ``masters`` store it implies
    (``masters.make_master_store``), the step's rules (clipping, the non-finite policy) and the
    data-parallel ranks. ``on_unbracketed_grad`` is called when a gradient arrives outside a
    backward bracket (a plain ``loss.backward()`` whose outputs the engine could not hook): once per
    such backward, before the gradient is handled, so that the caller can open the bracket.
    """

    def __init__(self, groups: list[FlatParamGroup], grads, placement: Placement, masters: MastersInMemory,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], scaler: LossScaler,
                 rules: StepRules, ranks: Ranks, on_unbracketed_grad: Callable[[], None] = lambda: None):
        self.groups = groups
        self.device = ranks.device  # the compute device: the step's control values are reduced there
        self.world, self.rank, self.comm_group = ranks.world, ranks.rank, ranks.group  # the ranks sharded over
        self.replication = ranks.replication  # MiCS: the dp_* below count each shard group's copy too
        self.dp_world, self.dp_rank, self.dp_group = ranks.dp_world, ranks.dp_rank, ranks.dp_group
        self.nonfinite = rules.nonfinite
        self.clip = rules.clip
        self.allgather_bucket_numel = int(rules.allgather_bucket_numel)
        self.accumulation_steps = int(rules.accumulation_steps)  # (set_train_batch_size changes it)
        self.window_multiplier: Optional[float] = None  # the engine's: what the window's gradients carry
        self.placement = placement
        self.master_store = masters
        self.grads = grads
        self.scaler = scaler
        self._on_unbracketed_grad = on_unbracketed_grad
        self._in_backward = False  # between begin_backward and end_backward
        self._had_backward = False  # since the last boundary step
        self.masters = [masters.make(g) for g in groups]  # [owned numel] fp32 each (empty when swapped)
        self.shard_params = [nn.Parameter(m, requires_grad=True) for m in self.masters]
        self.optimizer = masters.wrap_optimizer(
            make_optimizer([{**g.hyper, "params": [sp]} for g, sp in zip(groups, self.shard_params)]))
        self.abilities = abilities(self.optimizer)  # what it can do beyond torch.optim.Optimizer
        self.step_counts = StepCounts(groups)  # per parameter, as torch counts (unused ones are not stepped)
        self.run_stepper = RunStepper(self.step_counts)  # steps any torch optimizer by runs when counts differ
        self.global_grad_norm: Optional[float] = None
        full_state.register(self)  # zengine.utils.safe_get_full_* find parameters through it
        self.grad_hooks = GradHooks(groups, self._on_grad)
        self._versions = [g.params_version() for g in groups]  # as last written by zengine (write_back)

    # -- torch.optim.Optimizer look-alike -------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients (the engine does this after every boundary step)."""
        self.grads.zero()
        for g in self.groups:
            g.used = [False] * len(g.params)
        for sp in self.shard_params:
            sp.grad = None

    # -- backward -------------------------------------------------------------------------------
    def _on_grad(self, gi: int, pi: int, param: torch.Tensor) -> None:
        if not self._in_backward:  # nobody opened the bracket: a plain backward seen first here
            self._on_unbracketed_grad()
        self.groups[gi].used[pi] = True
        self.grads.on_grad(gi, pi)

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        self._had_backward = True
        self._in_backward = True
        self.grads.begin_backward(boundary, no_sync)

    def end_backward(self) -> None:
        self._in_backward = False
        self.grads.end_backward()

    def explain_backward_error(self, error: RuntimeError) -> BaseException:
        """The error to raise for ``error`` from autograd in ``engine.backward``: itself, unless the stage knows
        the misuse behind it (stage 3: a partitioned parameter used outside the forward)."""
        return error

    def forward_context(self):
        """What the engine's forward runs inside (stage 3 gathers parameters there)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Finish every collective in flight and release files and I/O threads (``Engine.destroy``)."""
        self.grads.drain()
        self.abilities.close()  # NVMe swapping owns a file and I/O threads
        self.placement.close()
        self.grad_hooks.remove()

    # -- the boundary step ----------------------------------------------------------------------
    def grad_unscale(self) -> float:
        """What the summed gradients are multiplied by to become the mean gradient of the global batch:
        1 / (data-parallel world x loss scale x accumulation steps). In fp32/bf16 the accumulation steps are divided here,
        once, rather than in each loss, so a gradient counts once whichever path it took to its parameter
        (engine/backward.py); fp16 divides each loss instead (``accumulation_steps`` is then 1). The engine
        sets ``window_multiplier`` (loss factor x accumulation steps) from the passes it saw: a plain fp16
        ``loss.backward()`` carries no loss scale."""
        if self.window_multiplier is not None:  # set by the engine: what this window's passes multiplied
            return 1.0 / (self.dp_world * self.window_multiplier)
        return 1.0 / (self.dp_world * self.scaler.scale * self.accumulation_steps)

    def _master_grads(self) -> list[torch.Tensor]:
        return self.master_store.grads(self)

    def _sq_norm(self, master_grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squares of this rank's part of the gradient: a 0-dim float64 where the gradients are."""
        return self.master_store.sq_norm(self, master_grads)

    def step(self, micro_step: int = 0) -> StepOutcome:
        """Run the boundary step. ``micro_step`` is the engine's count, compared across ranks."""
        self._adopt_outside_writes()
        used = [u for g in self.groups for u in g.used]

        def stats_of(master_grads: list[torch.Tensor], **extra):
            # over every data-parallel rank: with MiCS only copy 0 counts its shards in the norm (norm_range)
            return gather_stats(self._sq_norm(master_grads), self._had_backward, micro_step, used, self.device,
                                self.dp_world, self.dp_rank, self.dp_group, fetches=self._fetch_check(), **extra)

        unreduced = self.grads.unreduced  # the boundary backward ran under no_sync: no sum over ranks yet
        master_grads = self._master_grads() if not unreduced else []  # (it scales the summed gradient in place)
        stats = stats_of(master_grads, unreduced=unreduced, order=self.grads.order_digests())
        if stats.ranks_with_backward:  # the gradient buckets' launch order, fixed at the first real step
            self.grads.settle_order(stats.orders_agree)
        if stats.ranks_unreduced:  # every rank's boundary backward ran under no_sync: reduce now (rare)
            self.grads.reduce_pending()
            master_grads = self._master_grads()
            stats = stats_of(master_grads)
        if not stats.fetches_agree:  # stage 3: the ranks gathered different parameters (nothing updated yet)
            self._raise_fetches_diverged()
        self._fetches_checked()
        self._before_update()
        self._had_backward = False
        if stats.ranks_with_backward == 0:
            self.zero_grad()
            return StepOutcome.NO_BACKWARD
        norm = stats.norm
        self.global_grad_norm = norm
        finite = math.isfinite(norm)
        if not finite and self.scaler.dynamic:
            self.scaler.update(True)
        if not self.nonfinite.applies(finite, norm, self.scaler.dynamic, lambda: self._where_nonfinite(master_grads),
                                      f"; loss scale now {self.scaler.scale:g}" if self.scaler.dynamic else ""):
            self.zero_grad()
            return StepOutcome.SKIPPED
        if self.clip > 0 and finite:
            coef = self.clip / (norm + 1e-6)
            if coef < 1.0:
                self._clip_grads(master_grads, coef)
        for sp, grad in zip(self.shard_params, master_grads):
            sp.grad = grad
        used = self._used_by_group(stats.used_counts)
        plans = [self.step_counts.plan(gi, u) for gi, u in enumerate(used)]
        owned = self._copy_out_owned() if all(p.uniform is not None for p in plans) else {}
        if self.master_store.pieces_owe(master_grads):  # offload on a device with side streams: with the copies
            self.master_store.step_in_pieces(self, shard_runs(self.groups, self.shard_params, plans), owned)
        else:
            self._run_optimizer(plans, owned)
        for gi, u in enumerate(used):
            self.step_counts.advance(gi, u)
            self.run_stepper.prune(gi)
        self.write_back(skip_copy=bool(owned))
        if finite:
            self.scaler.update(False)
        self.zero_grad()
        return StepOutcome.APPLIED

    # -- stage 3's gather check rides on the step's all-reduce (stage3/optimizer.py overrides) -----
    def _fetch_check(self) -> tuple:
        """(digest half, digest half, device count of mixed gathers or None) of this rank's gathers."""
        return (0, 0, None)

    def _raise_fetches_diverged(self) -> None:
        raise AssertionError("only stage 3 gathers parameters")

    def _fetches_checked(self) -> None:
        """The ranks agreed on their gathers so far: start the next comparison."""

    def _before_update(self) -> None:
        """Right before the step writes anything: stage 3 waits for uploads still reading host shards."""

    def _clip_grads(self, master_grads: list[torch.Tensor], coef: float) -> None:
        self.master_store.clip(self, master_grads, coef)

    def _where_nonfinite(self, master_grads: list[torch.Tensor]):
        """Where the first non-finite gradient element is (for the skip message)."""
        return self.master_store.where_nonfinite(self, master_grads)

    # -- parameters no rank used keep their values and optimizer state (step_counts.py) ---------
    def _used_by_group(self, used_counts: list[float]) -> list[list[bool]]:
        """Per group, per parameter: whether any rank gave it a gradient since the last step."""
        out, k = [], 0
        for g in self.groups:
            out.append([c > 0 for c in used_counts[k:k + len(g.params)]])
            k += len(g.params)
        return out

    def _run_optimizer(self, plans, owned: dict[int, torch.Tensor]) -> None:
        """Step the wrapped optimizer as the plans say: an optimizer that steps ranges itself gets each
        group's runs with their step numbers; any other steps whole groups whole and the rest by runs.
        ``owned`` (``_copy_out_owned``): the parameter slices it writes as it steps."""
        if not self.abilities.steps_runs:
            self.run_stepper.step(self.optimizer, self.shard_params, plans)
            return
        runs = shard_runs(self.groups, self.shard_params, plans)
        copies = self.placement.optimizer.copies
        copy_out = {self.shard_params[gi]: copies.copy_out_target(gi, o) for gi, o in owned.items()}
        if copy_out:
            # CPUAdam writes the updated master into the compute-dtype parameters in the same pass
            # (on a GPU, into pinned staging that the placement's copies then upload).
            self.placement.optimizer.copies.before_step()
            self.abilities.step_runs(runs, copy_out)
            self.placement.optimizer.copies.after_step()
        else:
            self.abilities.step_runs(runs, {})

    # -- write-back and gather ------------------------------------------------------------------
    def _copy_out_owned(self) -> dict[int, torch.Tensor]:
        """gi -> the compute-dtype parameter slice, for the groups whose parameters the optimizer can write
        while stepping (not a master that is their own storage; on a device, through staging: copies.py)."""
        if not (self.abilities.writes_params and self.placement.copies_out):
            return {}
        return {gi: g.owned_params() for gi, (g, m) in enumerate(zip(self.groups, self.masters))
                if m.data_ptr() != g.owned_params().data_ptr()}

    def write_back(self, skip_copy: bool = False) -> None:
        """The compute-dtype parameters from the fp32 masters (where the placement keeps them), published
        to the ranks that need them. ``skip_copy``: the step wrote them already (copy-out)."""
        for g, master in zip(self.groups, self.masters):
            if not self.master_store.step_writes_params:
                self.placement.params.store(g, master, copied=skip_copy)
            g.publish(self.allgather_bucket_numel, self.comm_group)
        self._versions = [g.params_version() for g in self.groups]

    def _adopt_outside_writes(self) -> None:
        """Parameters written in place since zengine last wrote them (``engine.module.load_state_dict(sd)``,
        an in-place edit under ``torch.no_grad()``) become the masters' values, as a torch optimizer would
        step from them; otherwise the next write-back would silently restore the old values. Seen from the
        flat buffers' version counters: one integer comparison per group."""
        if self.master_store.step_writes_params:  # ZeRO-Infinity: parameters change only through zengine
            return
        for gi, (g, master) in enumerate(zip(self.groups, self.masters)):
            if master.data_ptr() == g.owned_params().data_ptr():
                continue  # the master is the parameters' own storage (fp32 on the device): nothing to adopt
            if g.params_version() != self._versions[gi]:
                with torch.no_grad():
                    self.placement.params.load(g, master)
                self._versions[gi] = g.params_version()

    def refresh_param(self, gi: int, pi: int, value: torch.Tensor) -> None:
        """After ``safe_set_full_fp32_param``: the compute-dtype parameter shows ``value`` (stages 0-2
        keep every parameter whole on every rank)."""
        with torch.no_grad():
            self.groups[gi].params[pi].data.copy_(value.reshape(self.groups[gi].params[pi].shape))

    # -- full parameters on request -------------------------------------------------------------
    @contextlib.contextmanager
    def summon(self, writeback: bool = True, rank0_only: bool = False, offload_to_cpu: bool = False,
               with_grads: bool = False):
        """Stages 0-2 keep parameters whole (and stages 0-1 their gradients): with ``writeback`` changes go
        into the fp32 masters, else they are undone on exit."""
        snapshot = None if writeback else [[t.clone() for t in g.tensors()] for g in self.groups]
        try:
            yield
        finally:
            with torch.no_grad():
                for g, master in zip(self.groups, self.masters):
                    if snapshot is not None:
                        for t, saved in zip(g.tensors(), snapshot.pop(0)):
                            t.copy_(saved)
                    elif master.data_ptr() != g.owned_params().data_ptr():
                        master.copy_(g.owned_params())

    @contextlib.contextmanager
    def states_resident(self):
        """A context inside which every optimizer state tensor is in ``optimizer.state`` and ``masters``
        hold values (checkpoints use it; NVMe offload reads the swapped states in for its duration)."""
        self._adopt_outside_writes()  # a checkpoint or safe_get_full_* sees the parameters' current values
        with self.abilities.states_in_memory(), self.master_store.resident(self):
            yield

    # -- accounting -----------------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this optimizer holds, by kind (for the engine's memory breakdown)."""
        masters = [m for g, m in zip(self.groups, self.masters) if m.data_ptr() != g.owned_params().data_ptr()]
        states = [t for sp in self.shard_params for t in self.optimizer.state.get(sp, {}).values()
                  if torch.is_tensor(t) and t.numel() > 1]
        states += self.abilities.host_buffers()  # the NVMe swap buffers
        grads = self.grads.tensors() + list(self.master_store.grad_buffers.values())  # (stages 0-1 offload: host)
        return {"parameters": [t for g in self.groups for t in g.tensors()], "gradients": grads, "master_weights": masters,
                "optimizer_states": states, "workspace": self.grads.workspace()}  # (workspace: not model state)
