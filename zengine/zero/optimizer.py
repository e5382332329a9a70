"""The ZeRO optimizer for stages 0-2: master weights, the boundary step, write-back.

A stage is a composition, chosen once:

    stage 0: replicated master (num_shards = 1) + FullGradients
    stage 1: sharded master    (num_shards = W) + FullGradients
    stage 2: sharded master    (num_shards = W) + ShardReducer (flat_buckets.sharded_gradients)

Every stage runs the same boundary step (``ZeroOptimizer.step``), in three
parts: agree (1-3), decide (4: apply, skip or nothing to do), apply (5):

1. finish the reduction (``grads.end_backward`` already waited on it);
2. build each group's fp32 master gradient from the summed gradient, times
   ``GradFactor.unscale()`` (``precision/grad_factor.py``: 1 / (world x what
   the window's losses were multiplied by); one pass; a view, no copy, in fp32);
3. one all-reduce of the step's control values (``step_stats.py``: sum of
   squares over this rank's part, whether it ran a backward, its micro-step
   count, used flags) on the compute device, read on the host once: the
   global norm before clipping, overflow, ranks out of step, and which
   parameters got a gradient on any rank;
4. when the norm is not finite, skip (``nonfinite.py``);
5. else clip, step the wrapped torch optimizer on the flat master shards (a parameter no rank
   gave a gradient is not stepped and keeps its own step count, as in torch:
   ``step_counts.py``), write the master back into
   the compute-dtype parameters and gather them in buckets of
   ``allgather_bucket_size``.

The wrapped optimizer is any ``torch.optim.Optimizer``; it sees one flat
fp32 parameter per group, so its state is sharded with the master
(``shard_step.py`` steps it as its declared abilities allow).

Where the states live (device, host memory, NVMe) is not a branch here: the
``placement`` builds the master store (``masters.py``), which hands each
step its master gradients (whole, in pieces or swapped), and the step calls
them. With the optimizer on the host of a device with side streams the
master gradients take step 5 in pieces, overlapped with the copies of
gradients down and parameters up (``offload/masters.py``,
``offload/step_pipeline.py``). Stage 3 joins the agreement as a
``StepParticipant`` (its gather check rides on the step's all-reduce).
"""

from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from ..ops.adam import COMPENSATION

from ..offload.placement import Placement
from ..precision.grad_factor import GradFactor
from . import full_state, user_clipping
from .param_writes import check_writes
from .base_optimizer import ZeROOptimizer  # DeepSpeed's base: its state_dict, isinstance
from .flat_group import ParamGroup, whole_params
from .grad_hooks import GradHooks
from .masters import MasterGrads, MasterStore
from .mics import Replication
from .nonfinite import NonFinitePolicy
from .shard_step import ShardStepper
from .step_counts import StepCounts, used_by_group
from .step_stats import RankValues, StepStats, first_nonfinite, gather_stats
from .sub_groups import GroupMap


@dataclass(frozen=True)
class ShardGroup:
    """This rank in the group the model states are sharded over (built from the process's
    ``ProcessRank`` by ``stages.shard_group``; with MiCS a shard group smaller than the world)."""

    world: int
    rank: int
    device: torch.device  # the compute device
    group: Any = None  # the process group (None: the default one)
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


@dataclass(frozen=True)
class StepRules:
    """How the boundary step treats the gradient and publishes the parameters."""

    clip: float  # gradient_clipping (0: off)
    nonfinite: NonFinitePolicy  # skip, warn or raise on a non-finite gradient
    allgather_bucket_numel: int  # parameters gathered per bucket after the step (stages 1-2)


class StepOutcome(enum.Enum):
    """What a boundary step did."""

    APPLIED = "applied"
    SKIPPED = "skipped"  # the gradient was not finite (nonfinite.py)
    NO_BACKWARD = "no_backward"  # no rank ran a backward since the last step: nothing to do


@dataclass(frozen=True)
class Decision:
    """What the ranks decided, from the agreed values: the outcome, and for an applied step whether
    the gradient was finite and the clip coefficient to apply (None: no clipping)."""

    outcome: StepOutcome
    finite: bool = True
    clip_coef: Optional[float] = None


class StepParticipant(Protocol):
    """A part of the stage that joins the boundary step: it brings values to the ranks' agreement,
    acts on what they agreed, and prepares for the update (stage 3's gather check:
    ``stage3/optimizer.GatherAgreement``)."""

    def agreement_values(self) -> tuple[tuple[int, int], Optional[torch.Tensor]]:
        """What it adds to the all-reduce: a digest's two halves (< 2^16 each) and a device count
        that must sum to zero (None: nothing to count)."""

    def agreed(self, stats: StepStats) -> None:
        """After the agreement, before anything is updated (raise here when the ranks diverged)."""

    def before_update(self) -> None:
        """Right before the step writes anything."""


class NoParticipant:
    """Stages 0-2: nothing joins the step."""

    def agreement_values(self) -> tuple[tuple[int, int], Optional[torch.Tensor]]:
        return (0, 0), None

    def agreed(self, stats: StepStats) -> None:
        if not stats.fetches_agree:
            raise AssertionError("only stage 3 gathers parameters")

    def before_update(self) -> None:
        """Nothing in flight reads what the step writes."""


class ZeroOptimizer(ZeROOptimizer):
    """Owns the groups, the gradient store, the master store and the wrapped optimizer.

    Everything it is made of comes in at construction: the groups and gradient store of its stage,
    the ``placement`` (where states live) and the ``masters`` store it built
    (``Placement.master_store``), the gradient factor, the step's rules (clipping, the non-finite
    policy), the data-parallel ranks and what else joins the step (``participant``).
    ``on_unbracketed_grad`` is called when a gradient arrives outside a backward bracket (a plain
    ``loss.backward()`` whose outputs the engine could not hook): once per such backward, before the
    gradient is handled, so that the caller can open the bracket.
    """

    def __init__(
        self,
        groups: list[ParamGroup],
        grads,
        placement: Placement,
        masters: MasterStore,
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        grad_factor: GradFactor,
        rules: StepRules,
        ranks: ShardGroup,
        on_unbracketed_grad: Callable[[], None] = lambda: None,
        participant: StepParticipant = NoParticipant(),
        group_map: Optional[GroupMap] = None,
    ):
        self.groups = groups
        # which of the wrapped optimizer's param groups each group's shard sits in (sub_groups.py)
        self.group_map = group_map or GroupMap.identity(len(groups))
        self.device = (
            ranks.device
        )  # the compute device: the step's control values are reduced there
        self.world, self.rank, self.comm_group = (
            ranks.world,
            ranks.rank,
            ranks.group,
        )  # the ranks sharded over
        self.replication = (
            ranks.replication
        )  # MiCS: the dp_* below count each shard group's copy too
        self.dp_world, self.dp_rank, self.dp_group = ranks.dp_world, ranks.dp_rank, ranks.dp_group
        self.nonfinite = rules.nonfinite
        self.clip = rules.clip
        self.allgather_bucket_numel = int(rules.allgather_bucket_numel)
        self.grad_factor = grad_factor  # what the summed gradients are multiplied by at the step
        self.scaler = grad_factor.scaler
        self.placement = placement
        self.master_store = masters
        self.grads = grads
        self.participant = participant
        self._on_unbracketed_grad = on_unbracketed_grad
        self._in_backward = False  # between begin_backward and end_backward
        self._had_backward = False  # since the last boundary step
        self.shard_params = masters.shard_params  # one flat fp32 parameter per group, its master
        self.optimizer = masters.wrap_optimizer(
            make_optimizer(
                self.group_map.optimizer_groups([g.hyper for g in groups], self.shard_params)
            )
        )
        self.step_counts = StepCounts(
            groups
        )  # per parameter, as torch counts (unused ones are not stepped)
        self.stepper = ShardStepper(
            groups,
            self.shard_params,
            self.optimizer,
            self.step_counts,
            placement.optimizer.copies,
            placement.copies_out,
            self.group_map,
        )
        self.abilities = self.stepper.abilities  # what it can do beyond torch.optim.Optimizer
        self.run_stepper = self.stepper.run_stepper
        self.global_grad_norm: Optional[float] = None
        full_state.register(self)  # zengine.utils.safe_get_full_* find parameters through it
        user_clipping.install()  # a script's own clipping of shard-held gradients: refused by name
        self.grad_hooks = GradHooks(groups, self._on_grad)

    @property
    def masters(self) -> list[torch.Tensor]:
        """[owned numel] fp32 per group (no storage when swapped, outside ``states_resident``)."""
        return self.master_store.masters

    # (param_groups, state, defaults: the wrapped optimizer's, as DeepSpeedOptimizer shows them)
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

    # -- the boundary step: agree, decide, apply --------------------------------------------------
    def check_param_writes(self) -> None:
        """Raise ``ParameterWriteError`` for a script's write to a trained parameter that the step
        would lose (``param_writes.py``), before anything is updated."""
        check_writes(self.groups)

    def step(self, micro_step: int = 0) -> StepOutcome:
        """Run the boundary step. ``micro_step`` is the engine's count, compared across ranks."""
        self.check_param_writes()  # p.data = t, or a stage-3 write outside a gather: nothing updated
        stats, master_grads = self._agree(micro_step)
        self._had_backward = False
        decision = self._decide(stats, master_grads)
        if decision.outcome is StepOutcome.APPLIED:
            self._apply(stats, master_grads, decision)
        self.zero_grad()
        return decision.outcome

    def _master_grads(self) -> MasterGrads:
        return self.master_store.master_grads(
            self.grads,
            self.grads.unscale_held(self.grad_factor.unscale()),
            self.stepper.steps_in_pieces,
        )

    def _sq_norm(self, master_grads: MasterGrads) -> torch.Tensor:
        """Sum of squares of this rank's part of the gradient: 0-dim float64, where it is."""
        return master_grads.sq_norm()

    def _agree(self, micro_step: int) -> tuple[StepStats, MasterGrads]:
        """The ranks' one all-reduce of the step's control values (``step_stats.py``), the gradients
        summed over the ranks first where a no_sync boundary left them local; raises when the ranks
        are out of step or (a participant) diverged. Nothing is updated yet."""
        self.master_store.adopt_param_writes()  # (a load or an in-place edit since the last step)
        used = [u for g in self.groups for u in g.used]

        def stats_of(master_grads: MasterGrads, **extra) -> StepStats:
            # over every data-parallel rank: with MiCS only copy 0 counts its shards in the norm (norm_range)
            sq_norm = self._sq_norm(master_grads)
            digest, mixed = self.participant.agreement_values()
            mine = RankValues(
                sq_norm,
                self._had_backward,
                micro_step,
                used,
                fetch_digest=digest,
                mixed_gathers=mixed,
                **extra,
            )
            return gather_stats(mine, self.device, self.dp_world, self.dp_rank, self.dp_group)

        unreduced = (
            self.grads.unreduced
        )  # the boundary backward ran under no_sync: no sum over ranks yet
        # (master_grads scales the summed gradient in place)
        master_grads = (
            self._master_grads() if not unreduced else self.master_store.unreduced(self.grads)
        )
        stats = stats_of(master_grads, unreduced=unreduced, order=self.grads.order_digests())
        if (
            stats.ranks_with_backward
        ):  # the gradient buckets' launch order, fixed at the first real step
            self.grads.settle_order(stats.orders_agree)
        if (
            stats.ranks_unreduced
        ):  # every rank's boundary backward ran under no_sync: reduce now (rare)
            self.grads.reduce_pending()
            master_grads = self._master_grads()
            stats = stats_of(master_grads)
        self.participant.agreed(stats)
        self.participant.before_update()
        return stats, master_grads

    def _decide(self, stats: StepStats, master_grads: MasterGrads) -> Decision:
        """From the agreed values, alike on every rank: nothing to do, skip, or apply (clipped?)."""
        if stats.ranks_with_backward == 0:
            return Decision(StepOutcome.NO_BACKWARD)
        norm = stats.norm
        self.global_grad_norm = norm
        finite = math.isfinite(norm)
        if not finite and self.scaler.dynamic:
            self.scaler.update(True)
        if not self.nonfinite.applies(
            finite,
            norm,
            self.scaler.dynamic,
            lambda: self._where_nonfinite(master_grads),
            f"; loss scale now {self.scaler.scale:g}" if self.scaler.dynamic else "",
        ):
            return Decision(StepOutcome.SKIPPED)
        coef = self.clip / (norm + 1e-6) if self.clip > 0 and finite else 1.0
        return Decision(StepOutcome.APPLIED, finite, coef if coef < 1.0 else None)

    def _apply(self, stats: StepStats, master_grads: MasterGrads, decision: Decision) -> None:
        """Clip, step the wrapped optimizer on the master shards, write the parameters back."""
        if decision.clip_coef is not None:
            master_grads.clip(decision.clip_coef)
        for sp, grad in zip(self.shard_params, master_grads.tensors):
            sp.grad = grad
        used = used_by_group(self.groups, stats.used_counts)
        plans = [self.step_counts.plan(gi, u) for gi, u in enumerate(used)]
        uniform = all(p.uniform is not None for p in plans)
        owned = self.stepper.copy_out_targets(self.masters) if uniform else {}
        master_grads.step(self.stepper, plans, owned)
        for gi, u in enumerate(used):
            self.step_counts.advance(gi, u)
            self.run_stepper.prune(gi)
        self.write_back(skip_copy=bool(owned))
        if decision.finite:
            self.scaler.update(False)

    def _where_nonfinite(self, master_grads: MasterGrads) -> str:
        """Where the first non-finite gradient element is (for the skip message)."""
        return first_nonfinite(
            self.groups, master_grads.nonfinite_search(), self.device, self.world, self.comm_group
        )

    # -- parameters no rank used keep their values and optimizer state (step_counts.py) ---------
    # -- write-back and gather ------------------------------------------------------------------
    def write_back(self, skip_copy: bool = False) -> None:
        """The compute-dtype parameters from the fp32 masters (where the placement keeps them), published
        to the ranks that need them. ``skip_copy``: the step wrote them already (copy-out)."""
        self.master_store.write_params(copied=skip_copy)
        for g in self.groups:
            g.publish(self.allgather_bucket_numel, self.comm_group)
        self.master_store.note_params_written()

    def refresh_param(self, gi: int, pi: int, value: torch.Tensor) -> None:
        """After ``safe_set_full_fp32_param``: the compute-dtype parameter shows ``value`` (stages 0-2
        keep every parameter whole on every rank)."""
        with torch.no_grad():
            self.groups[gi].params[pi].data.copy_(value.reshape(self.groups[gi].params[pi].shape))

    # -- full parameters on request -------------------------------------------------------------
    def summon(
        self,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ):
        """Stages 0-2 keep parameters whole (and stages 0-1 their gradients): with ``writeback`` changes go
        into the fp32 masters, else they are undone on exit (``flat_group.whole_params``)."""
        return whole_params(self.groups, self.masters, writeback)

    @contextlib.contextmanager
    def states_resident(self):
        """A context inside which every optimizer state tensor is in ``optimizer.state`` and ``masters``
        hold values (checkpoints use it; NVMe offload reads the swapped states in for its duration)."""
        self.master_store.adopt_param_writes()  # a checkpoint or safe_get_full_* sees them now
        with self.abilities.states_in_memory(), self.master_store.resident():
            yield

    # -- accounting -----------------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this optimizer holds, by kind (for the engine's memory breakdown)."""
        masters = [
            m
            for g, m in zip(self.groups, self.masters)
            if m.data_ptr() != g.owned_params().data_ptr()
        ]
        held = [
            (k, t) for sp in self.shard_params for k, t in self.optimizer.state.get(sp, {}).items()
        ]
        states = [t for k, t in held if torch.is_tensor(t) and t.numel() > 1 and k != COMPENSATION]
        masters += [t for k, t in held if k == COMPENSATION]  # Kahan's: a part of the bf16 master
        states += self.abilities.host_buffers()  # the NVMe swap buffers
        grads = self.grads.tensors() + self.master_store.grad_buffers()  # (stages 0-1 offload)
        return {
            "parameters": [t for g in self.groups for t in g.tensors()],
            "gradients": grads,
            "master_weights": masters,
            "optimizer_states": states,
            "workspace": self.grads.workspace(),
        }  # (workspace: not model state)
