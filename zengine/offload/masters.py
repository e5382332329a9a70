"""The fp32 masters in memory and their gradients, as the boundary step sees them.

``MastersInMemory`` (every placement but ZeRO-Infinity, whose store is ``infinity.SwappedMasters``):
each group's master is a tensor where the placement keeps it (on the device, or in host memory). At
each step it hands the step a master-gradient object (``zero/masters.MasterGrads``), one of two:

- ``WholeMasterGrads``: each group's master gradient built from the summed gradient, scaled in one
  pass; the norm is taken over it, it is clipped in place and the wrapped optimizer steps on it;
- ``MasterGradsInPieces`` (the optimizer on the host of a device with side streams,
  ``copies.StreamCopies``, and an optimizer that steps pieces: CPU-Adam, NVMe's ``SwappedAdam``):
  the master gradients are the host shards while their pieces are still landing; the norm is summed
  on the device where it can be (a region written by one reduced piece) so it need not wait for the
  copies; scaling and clipping become factors applied to each piece once it has landed, right before
  the optimizer steps it (``step_pipeline.py``): the same per-element operations as a step taken
  whole.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, TypeVar

import torch
from torch import nn

from ..ops.grad import sum_of_squares
from .step_pipeline import Piece, StepPipeline, split

if TYPE_CHECKING:  # offload/ never imports zero/ at run time (zero/ builds on offload/)
    from ..zero.flat_group import ParamGroup
    from ..zero.masters import GradientReader
    from ..zero.shard_step import ShardStepper
    from ..zero.step_counts import Plan
    from .placement import OptimizerHome, ParamsHome

G = TypeVar("G")


def norm_squares(
    groups: list["ParamGroup"], grads: list[torch.Tensor], world: int, device: torch.device
) -> torch.Tensor:
    """Sum of squares of this rank's part of ``grads`` (each group's ``norm_range``): a 0-dim
    float64 where the gradients are, or zero on ``device`` when this rank counts none."""
    parts = []
    for g, grad in zip(groups, grads):
        lo, hi = g.norm_range(world)
        if hi > lo:
            parts.append(sum_of_squares(grad[lo:hi]))
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    on_host = [p for p in parts if p.device.type == "cpu"]
    on_device = [p for p in parts if p.device.type != "cpu"]
    if not (on_host and on_device):
        return torch.stack(parts).sum()
    # partial offload: each share summed where it is; the host's 0-dim sum joins the device's as a
    # scalar operand (read by the host, no copy to wait for)
    return torch.stack(on_device).sum() + torch.stack(on_host).sum()


class WholeMasterGrads:
    """Each group's fp32 master gradient, scaled already: what the step takes whole."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        groups: list["ParamGroup"],
        world: int,
        norm_device: torch.device,
        copies,
    ):
        self.tensors = tensors  # [owned] fp32 each, where the master is
        self._groups, self._world, self._norm_device = groups, world, norm_device
        self._copies = copies

    def sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's part of the gradient: 0-dim float64, where it is."""
        return norm_squares(self._groups, self.tensors, self._world, self._norm_device)

    def clip(self, coef: float) -> None:
        for grad in self.tensors:
            grad.mul_(coef)

    def nonfinite_search(self) -> list[torch.Tensor]:
        """The gradients to search for the first non-finite element, landed."""
        self._copies.settle()
        return self.tensors

    def step(
        self, stepper: "ShardStepper", plans: list["Plan"], owned: Mapping[int, torch.Tensor]
    ) -> None:
        stepper.step(plans, owned)


class MasterGradsInPieces:
    """Each group's host master gradient while its pieces land: scaled and clipped piece by piece
    right before the optimizer steps that piece (module doc)."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        unscale: float,
        grads: "GradientReader",
        groups: list["ParamGroup"],
        world: int,
        copies,
        piece: int,
        stepped: Callable[[Piece], None],
    ):
        self.tensors = tensors  # [owned] fp32 each on the host, pieces landing; not yet scaled
        self._stepped = stepped  # after each piece is stepped (the parameters' home)
        self._unscale, self._coef = unscale, None  # the factors still owed to each piece
        self._grads, self._groups, self._world = grads, groups, world
        self._copies, self._piece = copies, piece

    def sq_norm(self) -> torch.Tensor:
        """The norm's sum of squares from the gradient store's parts (``landing_squares``): those on
        the device summed there, the host's added as a number (no copy), times the unscale factor
        squared."""
        device, host = [], 0.0
        for gi, g in enumerate(self._groups):
            lo, hi = g.norm_range(self._world)
            if hi > lo:
                on_device, on_host = self._grads.landing_squares(gi, lo, hi)
                device += on_device
                host += on_host
        square = self._unscale * self._unscale
        if not device:
            return torch.tensor(host * square, dtype=torch.float64)
        total = device[0] if len(device) == 1 else torch.stack(device).sum()
        return (total + host) * square

    def clip(self, coef: float) -> None:
        self._coef = coef  # applied to each piece once it has landed

    def nonfinite_search(self) -> list[torch.Tensor]:
        self._copies.settle()  # every piece landed (not scaled: finiteness is the same)
        return self.tensors

    def step(
        self, stepper: "ShardStepper", plans: list["Plan"], owned: Mapping[int, torch.Tensor]
    ) -> None:
        """The step in the optimizer's pieces, overlapped with the copies (``step_pipeline.py``);
        ``owned``: gi -> the compute-dtype parameter shard the optimizer writes for the groups it
        writes (the rest are written after the step)."""
        factor, coef, grads = self._unscale, self._coef, self.tensors

        def prepare(piece) -> None:
            # what a whole step's scaling and clip() would have done, in order: the same bits
            grad = grads[piece.gi][piece.lo : piece.hi]
            if factor != 1.0:
                grad.mul_(factor)
            if coef is not None:
                grad.mul_(coef)

        StepPipeline(self._copies, self._piece).run(
            stepper.abilities,
            stepper.shard_params,
            grads,
            stepper.runs(plans),
            prepare,
            owned,
            self._stepped,
        )


class MastersInMemory:
    """fp32 masters as tensors, where the optimizer home keeps them
    (``zero/masters.MasterStore``)."""

    def __init__(
        self,
        groups: list["ParamGroup"],
        home: "OptimizerHome",
        params: "ParamsHome",
        world: int,
        device: torch.device,
    ):
        self.groups, self.home, self.params = groups, home, params
        self.world, self.device = world, device  # the ranks sharded over; the compute device
        # [owned numel] fp32 each, where its group's home keeps it (partial offload: device or host)
        self.masters = [params.master(g, home.group_home(gi)) for gi, g in enumerate(groups)]
        self.shard_params = [nn.Parameter(m, requires_grad=True) for m in self.masters]  # stepped
        # gi -> [owned] fp32 in host memory (pinned on a GPU machine), made at the first step and
        # kept: the master gradient when the summed one is on the device and the master on the host
        # (stages 0-1 with offload), copied down on a side stream (copies.py), not into a fresh
        # pageable buffer
        self._grad_buffers: dict[int, torch.Tensor] = {}
        # as last written by zengine (write_params)
        self._versions = [g.params_version() for g in groups]

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer that steps ``shard_params`` (NVMe offload swaps its states)."""
        return self.home.wrap_optimizer(optimizer, self.shard_params)

    def gradient_store(self, in_memory: Callable[[], G], into_sink: Callable[..., G]) -> G:
        """The gradient store for these masters: gradients are summed into tensors
        (``in_memory()``)."""
        return in_memory()

    # -- the step's master gradients ------------------------------------------------------------
    def master_grads(self, grads: "GradientReader", unscale: float, steps_in_pieces: bool):
        """Each group's fp32 master gradient, the summed gradient times ``unscale``: in pieces where
        the optimizer ``steps_in_pieces`` and the copies allow it (module doc), else whole."""
        copies = self.home.copies
        if steps_in_pieces and copies.defers and self._landing_on_host(grads):
            return MasterGradsInPieces(
                self._landing_grads(grads),
                unscale,
                grads,
                self.groups,
                self.world,
                copies,
                self.piece_size(),
                lambda p: self.params.piece_stepped(
                    self.groups[p.gi], p.lo, p.hi, self.masters[p.gi]
                ),
            )
        out, landings = [], []
        for gi, master in enumerate(self.masters):
            summed = grads.owned_grad(gi)
            if summed.dtype == master.dtype and summed.device == master.device:
                out.append(summed)  # [owned] in the master's dtype, a view: no copy
                continue
            # the master's dtype from another, on the device: a transient
            if summed.device == master.device:
                out.append(torch.empty_like(master).copy_(summed))
                continue
            grad = self._grad_buffer(gi)
            # every group's copy queued before any wait
            landings.append(copies.download(grad, summed))
            out.append(grad)
        for landing in landings:
            landing.synchronize()
        if unscale != 1.0:
            for grad in out:
                grad.mul_(unscale)
        norm_device = self.home.master_device(self.device)
        return WholeMasterGrads(out, self.groups, self.world, norm_device, copies)

    def unreduced(self, grads: "GradientReader") -> WholeMasterGrads:
        """Before the gradients are summed over the ranks: none yet (its norm is zero)."""
        return WholeMasterGrads(
            [], self.groups, self.world, self.home.master_device(self.device), self.home.copies
        )

    def piece_size(self) -> int:
        """Elements per piece of a step in pieces: the optimizer home's, rounded as the parameters'
        home writes them (NVMe: whole aligned blocks)."""
        return self.params.piece_size(self.home.piece)

    def _grad_buffer(self, gi: int) -> torch.Tensor:
        """Group gi's host master gradient when the summed one is on the device (stages 0-1 with
        offload)."""
        master = self.masters[gi]
        grad = self._grad_buffers.get(gi)
        if grad is None or grad.numel() != master.numel():
            grad = self.home.group_home(gi).empty(master.numel(), master.dtype, self.device)
            self._grad_buffers[gi] = grad
        return grad

    def _landing_on_host(self, grads: "GradientReader") -> bool:
        """Every master gradient is fp32 on the host, where the shard is or copied down from the
        device; or (partial offload's device share) fp32 beside its master on the device."""
        for gi, master in enumerate(self.masters):
            summed = grads.landing_grad(gi)
            if master.device.type != "cpu" and summed.device != master.device:
                return False
            if summed.device == master.device and summed.dtype != master.dtype:
                return False
        return True

    def _landing_grads(self, grads: "GradientReader") -> list[torch.Tensor]:
        """Each group's host master gradient, its pieces landing: the gradient shard itself (stages
        2-3), or the summed gradient on the device copied down piece by piece (stage 1), all queued
        now."""
        out = []
        for gi, master in enumerate(self.masters):
            summed = grads.landing_grad(gi)
            if summed.device == master.device:
                out.append(summed)
                continue
            grad = self._grad_buffer(gi)
            for piece in split([grad.numel()], self.piece_size()):
                # (the summed gradient is rewritten only after the step, which waits for them all)
                lo, hi = piece.lo, piece.hi
                self.home.copies.accumulate_async(grad[lo:hi], summed[lo:hi], overwrite=True)
            out.append(grad)
        return out

    # -- the compute-dtype parameters -----------------------------------------------------------
    def write_params(self, copied: bool) -> None:
        """After the step: the compute-dtype parameters from the masters (unless ``copied``)."""
        for g, master in zip(self.groups, self.masters):
            self.params.write_params(g, master, copied=copied)

    def note_params_written(self) -> None:
        """zengine wrote the parameters: later writes are someone else's
        (``adopt_param_writes``)."""
        self._versions = [g.params_version() for g in self.groups]

    def adopt_param_writes(self) -> None:
        """Parameters written in place since zengine last wrote them
        (``engine.module.load_state_dict(sd)``, an in-place edit under ``torch.no_grad()``) become
        the masters' values, as a torch optimizer would step from them; otherwise the next
        write-back would silently restore the old values. Seen from the flat buffers' version
        counters: one integer comparison per group."""
        for gi, (g, master) in enumerate(zip(self.groups, self.masters)):
            if master.data_ptr() == g.owned_params().data_ptr():
                # the master is the parameters' own storage (fp32 on the device): nothing to adopt
                continue
            if g.params_version() != self._versions[gi]:
                with torch.no_grad():
                    self.params.load(g, master)
                self._versions[gi] = g.params_version()

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Inside: ``masters`` hold their values (always, in memory)."""
        yield

    def grad_buffers(self) -> list[torch.Tensor]:
        """The host master gradients held between steps (for the memory breakdown)."""
        return list(self._grad_buffers.values())
