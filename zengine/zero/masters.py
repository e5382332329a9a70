"""The fp32 masters and their gradients, as the boundary step sees them: in memory, or swapped.

``MastersInMemory`` (every placement but ZeRO-Infinity): each group's master is a tensor where the
placement keeps it (on the device, or in host memory); the step builds each master gradient from
the summed gradient, takes the norm over it, clips it in place and steps the wrapped optimizer on
it.

``SwappedMasters`` (ZeRO-Infinity, ``offload/placement.InfinityPlacement``): the masters and their
gradients live in the optimizer's swap records. The gradient store writes each reduced bucket into
the file during backward (``GradSwap``) and keeps the sums of squares it wrote, which give the norm;
scaling and clipping become one factor the swapped step applies chunk by chunk
(``InfinityAdam.grad_scale``); the masters have values only inside ``resident()``.

With the optimizer on the host and a device with side streams (``offload/copies.StreamCopies``), a
``MastersInMemory`` step runs in pieces (``in_pieces``, ``step_in_pieces``): the master gradients are the
host shards while their pieces are still landing; the norm is summed on the device where it can be (a
region written by one reduced piece) so it need not wait for the copies; scaling and clipping become
factors applied to each piece once it has landed, right before CPU-Adam steps it
(``offload/step_pipeline.py``); the same per-element operations as a step taken whole.

``ZeroOptimizer`` holds one of these (``make_master_store``) and calls it where the two differ.
"""
from __future__ import annotations

import contextlib

import torch

from ..offload.infinity import MasterIO
from ..offload.param_swap import on_disk
from ..offload.placement import Placement
from ..offload.state_swap import GradSwap
from ..offload.step_pipeline import StepPipeline, clip_runs, split
from ..offload.swapped_adam import InfinityAdam
from ..ops.grad import sum_of_squares
from .step_stats import first_nonfinite


class MastersInMemory:
    """fp32 masters as tensors, where the placement keeps them."""

    def __init__(self, placement: Placement):
        self.placement = placement
        # gi -> [owned] fp32 in host memory (pinned on a GPU machine), made at the first step and kept: the
        # master gradient when the summed one is on the device and the master on the host (stages 0-1 with
        # offload), copied down on a side stream (offload/copies.py), not into a fresh pageable buffer
        self.grad_buffers: dict[int, torch.Tensor] = {}
        self.in_pieces = False  # this step runs in pieces, overlapped with the copies (set by grads())
        self._landing: list[torch.Tensor] = []  # in_pieces: each group's host master gradient, pieces landing
        self._factors: list = [1.0, None]  # in_pieces: (unscale factor, clip coefficient or None) still owed

    grad_sink = None  # gradients are summed into tensors (the gradient store's shards), not a swap file
    step_writes_params = False  # the step updates the masters; the parameters are written from them after

    def make(self, group) -> torch.Tensor:
        """Group ``group``'s fp32 master ([owned numel])."""
        return self.placement.params.master(group, self.placement.optimizer)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.placement.optimizer.wrap_optimizer(optimizer)

    def grads(self, opt) -> list[torch.Tensor]:
        """Each group's fp32 master gradient: the summed gradient times ``opt.grad_unscale()`` (``in_pieces``:
        not yet, and its pieces may still be landing; ``step_in_pieces`` settles and scales each)."""
        factor = opt.grad_unscale()
        self.in_pieces = self._can_step_in_pieces(opt)
        if self.in_pieces:
            self._factors = [factor, None]
            self._landing = self._landing_grads(opt)
            return self._landing
        copies = self.placement.optimizer.copies
        out, landings = [], []
        for gi, master in enumerate(opt.masters):
            summed = opt.grads.owned_grad(gi)
            if summed.dtype == torch.float32 and summed.device == master.device:
                out.append(summed)  # [owned] fp32, a view: no copy
                continue
            if summed.device == master.device:  # fp32 from the compute dtype, on the device: a transient
                out.append(torch.empty_like(master).copy_(summed))
                continue
            grad = self._grad_buffer(opt, gi)
            landings.append(copies.download(grad, summed))  # every group's copy queued before any wait
            out.append(grad)
        for landing in landings:
            landing.synchronize()
        if factor != 1.0:
            for grad in out:
                grad.mul_(factor)
        return out

    def _grad_buffer(self, opt, gi: int) -> torch.Tensor:
        """Group gi's host master gradient when the summed one is on the device (stages 0-1 with offload)."""
        master = opt.masters[gi]
        grad = self.grad_buffers.get(gi)
        if grad is None or grad.numel() != master.numel():
            grad = self.grad_buffers[gi] = self.placement.optimizer.empty(master.numel(), torch.float32, opt.device)
        return grad

    # -- a step in pieces (offload on a device with side streams) ------------------------------------
    def _can_step_in_pieces(self, opt) -> bool:
        """Downloads land after backward (side streams), the optimizer steps pieces (CPU-Adam), and every
        master gradient is fp32 on the host, where the shard is or copied down from the device."""
        if not (self.placement.optimizer.copies.defers and opt.abilities.steps_runs
                and opt.abilities.steps_in_pieces):
            return False
        for gi, master in enumerate(opt.masters):
            summed = opt.grads.landing_grad(gi)
            if master.device.type != "cpu" or (summed.device == master.device and summed.dtype != torch.float32):
                return False
        return True

    def _landing_grads(self, opt) -> list[torch.Tensor]:
        """Each group's host master gradient, its pieces landing: the gradient shard itself (stages 2-3), or
        the summed gradient on the device copied down piece by piece (stage 1), all queued now."""
        copies, out = self.placement.optimizer.copies, []
        for gi, master in enumerate(opt.masters):
            summed = opt.grads.landing_grad(gi)
            if summed.device == master.device:
                out.append(summed)
                continue
            grad = self._grad_buffer(opt, gi)
            for piece in split([grad.numel()], self.placement.optimizer.piece):
                # (the summed gradient is rewritten only after the step, which waited for every piece)
                copies.accumulate_async(grad[piece.lo:piece.hi], summed[piece.lo:piece.hi], overwrite=True)
            out.append(grad)
        return out

    def step_in_pieces(self, opt, runs: dict, owned: dict[int, torch.Tensor]) -> None:
        """The step over ``runs`` (shard param -> (lo, hi, step number) runs) in pieces, overlapped with the
        copies (``offload/step_pipeline.py``); ``owned``: gi -> the compute-dtype parameter shard CPU-Adam
        writes for the groups it writes (the rest are written after the step)."""
        factor, coef = self._factors
        grads = self._landing

        def prepare(piece) -> None:
            # what grads() and clip() would have done to the whole, in the same order: the same bits
            grad = grads[piece.gi][piece.lo:piece.hi]
            if factor != 1.0:
                grad.mul_(factor)
            if coef is not None:
                grad.mul_(coef)

        def step(piece, target) -> None:
            sp = opt.shard_params[piece.gi]
            piece_runs = {p: (clip_runs(r, piece.lo, piece.hi) if p is sp else []) for p, r in runs.items()}
            opt.abilities.step_runs(piece_runs, {sp: target} if target is not None else {})

        try:
            StepPipeline(self.placement.optimizer.copies, self.placement.optimizer.piece).run(grads, prepare, step,
                                                                                             owned)
            opt.abilities.record_steps(runs)
        finally:
            self.in_pieces, self._landing = False, []

    def sq_norm(self, opt, master_grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squares of this rank's part of the gradient: a 0-dim float64 where the gradients are (in
        pieces: on the compute device, unless the host had to sum all of it)."""
        if self.pieces_owe(master_grads):
            return self._landing_sq_norm(opt)
        parts = []
        for g, grad in zip(opt.groups, master_grads):
            lo, hi = g.norm_range(opt.world)
            if hi > lo:
                parts.append(sum_of_squares(grad[lo:hi]))
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=self.placement.optimizer.master_device(opt.device))
        return torch.stack([p.to(parts[0].device) for p in parts]).sum()

    def pieces_owe(self, master_grads: list[torch.Tensor]) -> bool:
        """Whether ``master_grads`` (from ``grads``) are this step's in pieces: not scaled or clipped yet, maybe
        not landed; ``step_in_pieces`` then takes the step."""
        return self.in_pieces and master_grads is self._landing

    def _landing_sq_norm(self, opt) -> torch.Tensor:
        """The norm's sum of squares from the gradient store's parts (``landing_squares``): those on the device
        summed there, the host's added as a number (no copy), times the unscale factor squared."""
        device, host = [], 0.0
        for gi, g in enumerate(opt.groups):
            lo, hi = g.norm_range(opt.world)
            if hi > lo:
                on_device, on_host = opt.grads.landing_squares(gi, lo, hi)
                device += on_device
                host += on_host
        square = self._factors[0] * self._factors[0]
        if not device:
            return torch.tensor(host * square, dtype=torch.float64)
        total = device[0] if len(device) == 1 else torch.stack(device).sum()
        return (total + host) * square

    def clip(self, opt, master_grads: list[torch.Tensor], coef: float) -> None:
        if self.pieces_owe(master_grads):  # applied to each piece once it has landed
            self._factors[1] = coef
            return
        for grad in master_grads:
            grad.mul_(coef)

    def where_nonfinite(self, opt, master_grads: list[torch.Tensor]):
        """Where the first non-finite gradient element is (for the skip message)."""
        self.placement.optimizer.copies.settle()  # (in pieces: some may still be landing)
        return first_nonfinite(opt.groups, master_grads, opt.device, opt.world, opt.comm_group)

    @contextlib.contextmanager
    def resident(self, opt):
        """Inside: ``opt.masters`` hold their values (always, in memory)."""
        yield


class SwappedMasters(MastersInMemory):
    """ZeRO-Infinity: masters and their gradients in the optimizer's swap records."""

    step_writes_params = True  # the swapped step writes each updated chunk into the parameters

    def __init__(self, placement: Placement, groups: list, dtype: torch.dtype):
        super().__init__(placement)
        self.io = MasterIO(groups, dtype, placement.optimizer.copies)
        # records [exp_avg | exp_avg_sq | master | grad] per chunk, aligned as the parameter shards
        self.swapper = placement.optimizer.swapper(self.io.numels, 4, self.io.align)
        self.grad_sink = GradSwap(self.swapper, placement.optimizer.copies)
        self._depth = 0  # resident() is re-entrant

    def make(self, group) -> torch.Tensor:
        return on_disk()  # in the swap file; values only inside resident()

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return InfinityAdam.replacing(optimizer, self.swapper, self.io, self.grad_sink)

    def grads(self, opt) -> list[torch.Tensor]:
        opt.optimizer.grad_scale = opt.grad_unscale()  # applied chunk by chunk in the step
        return [on_disk() for _ in opt.masters]  # what the step's .grad shows

    def sq_norm(self, opt, master_grads: list[torch.Tensor]) -> torch.Tensor:
        self.grad_sink.flush()  # every piece copied down and summed
        return opt.grads.swapped_sq() * opt.optimizer.grad_scale ** 2

    def clip(self, opt, master_grads: list[torch.Tensor], coef: float) -> None:
        opt.optimizer.grad_scale *= coef

    def where_nonfinite(self, opt, master_grads: list[torch.Tensor]):
        return super().where_nonfinite(opt, [opt.grads.owned_grad(gi) for gi in range(len(opt.groups))])

    @contextlib.contextmanager
    def resident(self, opt):
        """Inside: ``opt.masters`` show the values InfinityAdam read in (it is inside states_in_memory)."""
        self._depth += 1
        try:
            if self._depth == 1:
                opt.masters = [p.detach() for p in opt.shard_params]
            try:
                yield
            finally:
                if self._depth == 1:
                    opt.masters = [on_disk() for _ in opt.shard_params]
        finally:
            self._depth -= 1


def make_master_store(placement: Placement, groups: list, dtype: torch.dtype) -> MastersInMemory:
    """The master store the placement implies, for ``groups`` computed in ``dtype``."""
    if placement.optimizer.swaps_masters:
        return SwappedMasters(placement, groups, dtype)
    return MastersInMemory(placement)
