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
   the wrapped torch optimizer on the flat master shards (parameters no rank
   used are restored, as torch DDP leaves them), write the master back into
   the compute-dtype parameters and gather them in buckets of
   ``allgather_bucket_size``.

The wrapped optimizer is any ``torch.optim.Optimizer``; it sees one flat
fp32 parameter per group, so its state is sharded with the master.
"""
from __future__ import annotations

import contextlib
import enum
import math
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..precision.loss_scaler import LossScaler
from ..ops.grad import sum_of_squares
from . import full_state
from .flat_group import FlatParamGroup  # or any group with the same interface (stage 3's)
from .nonfinite import NonFinitePolicy
from ..offload.placement import DevicePlacement
from .step_stats import first_nonfinite, gather_stats


class StepOutcome(enum.Enum):
    """What a boundary step did."""

    APPLIED = "applied"
    SKIPPED = "skipped"          # the gradient was not finite (nonfinite.py)
    NO_BACKWARD = "no_backward"  # no rank ran a backward since the last step: nothing to do


class ZeroOptimizer:
    """Owns the flat groups, their fp32 masters, the gradient store and the wrapped optimizer."""

    def __init__(self, groups: list[FlatParamGroup], grads, placement: DevicePlacement,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 scaler: LossScaler, clip: float, allgather_bucket_numel: int, world: int, rank: int,
                 device: torch.device, comm_group=None):
        self.groups = groups
        self.device = device  # the compute device: the step's control values are reduced there
        self.nonfinite = NonFinitePolicy(rank=rank)  # the engine replaces it with the configured one
        # Called before each parameter gradient is handled: the engine opens its backward bracket there when
        # a plain loss.backward() reached a parameter first (engine/backward.py).
        self.before_grad: Callable[[], None] = lambda: None
        self._had_backward = False  # since the last boundary step
        self.placement = placement
        self.grads = grads
        self.scaler = scaler
        self.clip = clip
        self.allgather_bucket_numel = int(allgather_bucket_numel)
        self.world, self.rank, self.comm_group = world, rank, comm_group
        self.masters = [self._make_master(g) for g in groups]  # [owned numel] fp32 each
        self.shard_params = [nn.Parameter(m, requires_grad=True) for m in self.masters]
        self.optimizer = placement.wrap_optimizer(
            make_optimizer([{**g.hyper, "params": [sp]} for g, sp in zip(groups, self.shard_params)]))
        self.global_grad_norm: Optional[float] = None
        full_state.register(self)  # zengine.utils.safe_get_full_* find parameters through it
        self.grad_hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, gi, pi))
                      for gi, g in enumerate(groups) for pi, p in enumerate(g.params)]

    def _make_master(self, group) -> torch.Tensor:
        """The fp32 master of a group's owned parameters."""
        return self.placement.make_master(group.owned_params())

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
        self.before_grad()
        self.groups[gi].used[pi] = True
        self.grads.on_grad(gi, pi)

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        self._had_backward = True
        self.grads.begin_backward(boundary, no_sync)

    def end_backward(self) -> None:
        self.grads.end_backward()

    def forward_context(self):
        """What the engine's forward runs inside (stage 3 gathers parameters there)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Finish every collective in flight and release files and I/O threads (``Engine.destroy``)."""
        self.grads.drain()
        close = getattr(self.optimizer, "close", None)  # NVMe swapping owns a file and I/O threads
        if close is not None:
            close()
        for hook in self.grad_hooks:
            hook.remove()
        self.grad_hooks = []

    # -- the boundary step ----------------------------------------------------------------------
    def _master_grads(self) -> list[torch.Tensor]:
        factor = 1.0 / (self.world * self.scaler.scale)
        out = []
        for gi, (g, master) in enumerate(zip(self.groups, self.masters)):
            summed = self.grads.owned_grad(gi)
            if summed.dtype == torch.float32 and summed.device == master.device:
                grad = summed  # [owned] fp32, a view: no copy
            else:
                grad = torch.empty_like(master).copy_(summed)  # [owned] fp32 where the master lives
            if factor != 1.0:
                grad.mul_(factor)
            out.append(grad)
        return out

    def _sq_norm(self, master_grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squares of this rank's part of the gradient: a 0-dim float64 where the gradients are."""
        parts = []
        for g, grad in zip(self.groups, master_grads):
            lo, hi = g.norm_range(self.world)
            if hi > lo:
                parts.append(sum_of_squares(grad[lo:hi]))
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=self.placement.master_device(self.device))
        return torch.stack([p.to(parts[0].device) for p in parts]).sum()

    def step(self, micro_step: int = 0) -> StepOutcome:
        """Run the boundary step. ``micro_step`` is the engine's count, compared across ranks."""
        used = [u for g in self.groups for u in g.used]

        def stats_of(master_grads: list[torch.Tensor], **extra):
            return gather_stats(self._sq_norm(master_grads), self._had_backward, micro_step, used, self.device,
                                self.world, self.rank, self.comm_group, **extra)

        unreduced = self.grads.unreduced  # the boundary backward ran under no_sync: no sum over ranks yet
        master_grads = self._master_grads() if not unreduced else []  # (it scales the summed gradient in place)
        stats = stats_of(master_grads, unreduced=unreduced, order=self.grads.order_digests())
        if stats.ranks_with_backward:  # the gradient buckets' launch order, fixed at the first real step
            self.grads.settle_order(stats.orders_agree)
        if stats.ranks_unreduced:  # every rank's boundary backward ran under no_sync: reduce now (rare)
            self.grads.reduce_pending()
            master_grads = self._master_grads()
            stats = stats_of(master_grads)
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
        unused = self._unused_ranges(stats.used_counts)
        saved = self._save(unused) if unused else None
        copy_out = self._copy_out_targets() if not saved else {}
        if copy_out:
            # CPUAdam writes the updated master into the compute-dtype parameters in the same pass
            # (on a GPU, into pinned staging that the placement's copies then upload).
            self.placement.copies.before_step()
            self.optimizer.step_with_copy(copy_out)
            self.placement.copies.after_step()
        else:
            self.optimizer.step()
        if saved:
            self._restore(saved)
        self.write_back(skip_copy=bool(copy_out))
        if finite:
            self.scaler.update(False)
        self.zero_grad()
        return StepOutcome.APPLIED

    def _clip_grads(self, master_grads: list[torch.Tensor], coef: float) -> None:
        for grad in master_grads:
            grad.mul_(coef)

    def _where_nonfinite(self, master_grads: list[torch.Tensor]):
        """Where the first non-finite gradient element is (for the skip message)."""
        return first_nonfinite(self.groups, master_grads, self.device, self.world, self.comm_group)

    # -- parameters no rank used keep their values and optimizer state --------------------------
    def _unused_ranges(self, used_counts: list[float]) -> list[tuple[int, int, int]]:
        """(group, lo, hi) in master coordinates for every unused parameter piece this rank owns."""
        out, k = [], 0
        unused = [c == 0 for c in used_counts]
        for gi, g in enumerate(self.groups):
            for pi, lo, hi in g.master_pieces():
                if unused[k + pi]:
                    out.append((gi, lo, hi))
            k += len(g.params)
        return out

    def _state_tensors(self, gi: int) -> list[torch.Tensor]:
        sp = self.shard_params[gi]
        state = self.optimizer.state.get(sp, {})
        return [sp.data] + [t for t in state.values() if torch.is_tensor(t) and t.shape == sp.shape]

    def _save(self, ranges):
        keep = getattr(self.optimizer, "keep_unchanged", None)  # states it holds elsewhere (NVMe swap)
        if keep is not None:
            for gi, lo, hi in ranges:
                keep(self.shard_params[gi], lo, hi)
        return [(gi, lo, hi, [t[lo:hi].clone() for t in self._state_tensors(gi)]) for gi, lo, hi in ranges]

    def _restore(self, saved) -> None:
        for gi, lo, hi, copies in saved:
            for t, c in zip(self._state_tensors(gi), copies):
                t[lo:hi].copy_(c)

    # -- write-back and gather ------------------------------------------------------------------
    def _copy_out_targets(self) -> dict:
        """Shard param -> compute-dtype parameter slice, where the optimizer can write it while stepping."""
        if not hasattr(self.optimizer, "step_with_copy"):
            return {}
        copies = self.placement.copies
        return {sp: copies.copy_out_target(gi, g.owned_params())
                for gi, (sp, g, m) in enumerate(zip(self.shard_params, self.groups, self.masters))
                if m.data_ptr() != g.owned_params().data_ptr()}

    def write_back(self, skip_copy: bool = False) -> None:
        """The compute-dtype parameters from the fp32 masters, published to the ranks that need them."""
        for g, master in zip(self.groups, self.masters):
            owned = g.owned_params()
            if not skip_copy and owned.data_ptr() != master.data_ptr():
                owned.copy_(master)
            g.publish(self.allgather_bucket_numel, self.comm_group)

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

    def states_resident(self):
        """A context inside which every optimizer state tensor is in ``optimizer.state`` (checkpoints
        use it; NVMe offload reads the swapped moments in for its duration)."""
        resident = getattr(self.optimizer, "states_in_memory", None)
        return resident() if resident is not None else contextlib.nullcontext()

    # -- accounting -----------------------------------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this optimizer holds, by kind (for the engine's memory breakdown)."""
        masters = [m for g, m in zip(self.groups, self.masters) if m.data_ptr() != g.owned_params().data_ptr()]
        states = [t for sp in self.shard_params for t in self.optimizer.state.get(sp, {}).values()
                  if torch.is_tensor(t) and t.numel() > 1]
        states += getattr(self.optimizer, "host_buffers", list)()  # the NVMe swap buffers
        return {"parameters": [t for g in self.groups for t in g.tensors()], "gradients": self.grads.tensors(),
                "master_weights": masters, "optimizer_states": states}
