"""ZeRO-Infinity's optimizer side at stage 3: its master store, gradient sink and the chunk I/O the
NVMe-swapped step needs from the groups.

With ``offload_optimizer.device = "nvme"`` at stage 3 (``placement.InfinityPlacement``) the fp32
masters and the gradient shards are swapped with Adam's moments (``swapped_adam.InfinityAdam``: a
record ``[exp_avg | exp_avg_sq | master | grad]`` per chunk), so host memory for the optimizer is
the swap buffers. The placement builds the parts that go with it, all here:

- ``SwappedMasters``, the master store (``zero/masters.MasterStore``): the masters have values only
  inside ``resident()``; the gradient store writes each reduced bucket into the file during backward
  through its sink (``state_swap.GradSwap``) and keeps the sums of squares it wrote, which give the
  norm; scaling and clipping become one factor the swapped step applies chunk by chunk
  (``InfinityAdam.grad_scale``): ``SwappedMasterGrads``;
- ``MasterIO``: a chunk never stepped starts from the compute-dtype parameters (``init_master``,
  as a master in memory is made from them), and the updated chunk, cast to the compute dtype, goes
  where the parameters live (``params_out``: the parameter swap file with
  ``offload_param.device = "nvme"``, else the group's shard).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional, TypeVar

import torch
from torch import nn

from .copies import HostCopies
from .param_swap import align_elems, on_disk
from .state_swap import GradSwap
from .swapped_adam import InfinityAdam

if TYPE_CHECKING:  # offload/ never imports zero/ at run time (zero/ builds on offload/)
    from ..zero.masters import GradientReader
    from ..zero.shard_step import ShardStepper
    from ..zero.stage3.group import ShardedParamGroup
    from ..zero.step_counts import Plan
    from .placement import NVMePlacement

G = TypeVar("G")


class MasterIO:
    """Reads and writes a stage-3 group's compute-dtype shard by chunk, wherever it lives;
    ``copies`` (``copies.py``) moves the chunks of a shard on the device, without the host waiting
    for each."""

    def __init__(self, groups: list["ShardedParamGroup"], dtype: torch.dtype,
                 copies: Optional[HostCopies] = None):
        self.groups = groups
        self.align = align_elems(dtype)
        # the masters' sizes (their tensors are empty in memory)
        self.numels = [g.shard_numel for g in groups]
        self._resident = [g.resident() if not g.in_memory else [] for g in groups]
        self.copies = copies if copies is not None else HostCopies()
        self._landings: list = []  # init_master copies from the device not yet waited for

    def init_master(self, index: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` ([hi - lo] fp32) from group ``index``'s parameters; read it after ``ready()``."""
        g = self.groups[index]
        if g.in_memory:  # (queued while the chunks before it step: the swap reads this chunk ahead)
            self._landings.append(self.copies.download(out, g.shard_flat[lo:hi]))
        else:
            out.copy_(g.swap.read_range(g.base, lo, hi))

    def ready(self) -> None:
        """Every ``init_master`` so far has landed."""
        for landing in self._landings:
            landing.synchronize()
        self._landings = []

    def params_out(self, index: int, lo: int, hi: int, master: torch.Tensor) -> None:
        """Group ``index``'s parameters [lo, hi) from the updated fp32 ``master`` chunk (which may
        be rewritten as soon as this returns)."""
        g = self.groups[index]
        if g.in_memory:
            self.copies.upload(g.shard_flat[lo:hi], master)
        else:
            g.swap.write_range(g.base, lo, hi, master, self._resident[index])

    def flush(self) -> None:
        """Every parameter write has landed (the next gather may read them)."""
        for swap in {id(g.swap): g.swap for g in self.groups if not g.in_memory}.values():
            swap.flush()


class SwappedMasterGrads:
    """The master gradients in the swap records: their scale and clip coefficient become
    ``InfinityAdam.grad_scale``, applied chunk by chunk in the step."""

    def __init__(self, adam: InfinityAdam, sink: GradSwap, grads: "GradientReader", count: int,
                 copies: HostCopies):
        self.tensors = [on_disk() for _ in range(count)]  # what the step's .grad shows
        self._adam, self._sink, self._grads, self._copies = adam, sink, grads, copies

    def sq_norm(self) -> torch.Tensor:
        self._sink.flush()  # every piece copied down and summed
        return self._grads.swapped_sq() * self._adam.grad_scale ** 2

    def clip(self, coef: float) -> None:
        self._adam.grad_scale *= coef

    def nonfinite_search(self) -> list[torch.Tensor]:
        """The gradient shards as the gradient store reads them back from the file."""
        self._copies.settle()
        return [self._grads.owned_grad(gi) for gi in range(len(self.tensors))]

    def step(self, stepper: "ShardStepper", plans: list["Plan"],
             owned: Mapping[int, torch.Tensor]) -> None:
        stepper.step(plans, owned)


class SwappedMasters:
    """ZeRO-Infinity's master store: masters and their gradients in the optimizer's swap records."""

    def __init__(self, groups: list["ShardedParamGroup"], dtype: torch.dtype,
                 home: "NVMePlacement"):
        self.io = MasterIO(groups, dtype, home.copies)
        self.copies = home.copies
        # records [exp_avg | exp_avg_sq | master | grad] per chunk, aligned as the parameter shards
        self.swapper = home.swapper(self.io.numels, 4, self.io.align)
        # where the gradient store writes reduced buckets
        self.sink = GradSwap(self.swapper, home.copies)
        # in the swap file; values only inside resident()
        self.masters = [on_disk() for _ in groups]
        self.shard_params = [nn.Parameter(m, requires_grad=True) for m in self.masters]
        self.adam: Optional[InfinityAdam] = None  # made by wrap_optimizer
        self._depth = 0  # resident() is re-entrant

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.adam = InfinityAdam.replacing(optimizer, self.swapper, self.io, self.sink)
        return self.adam

    def gradient_store(self, in_memory: Callable[[], G], into_sink: Callable[[GradSwap], G]) -> G:
        """The gradient store for these masters: reduced gradients go to the swap records."""
        return into_sink(self.sink)

    def master_grads(self, grads: "GradientReader", unscale: float, steps_in_pieces: bool):
        self.adam.grad_scale = unscale  # applied chunk by chunk in the step
        return SwappedMasterGrads(self.adam, self.sink, grads, len(self.masters), self.copies)

    def unreduced(self, grads: "GradientReader"):
        """Before the gradients are summed over the ranks (the norm is not the global one)."""
        return SwappedMasterGrads(self.adam, self.sink, grads, len(self.masters), self.copies)

    def write_params(self, copied: bool) -> None:
        """The swapped step wrote each updated chunk into the parameters already."""

    def note_params_written(self) -> None:
        """Parameters change only through zengine here: nothing to track."""

    def adopt_param_writes(self) -> None:
        """Parameters change only through zengine here (written from the records)."""

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Inside: ``masters`` show the values InfinityAdam read in (inside states_in_memory)."""
        self._depth += 1
        try:
            if self._depth == 1:
                self.masters = [p.detach() for p in self.shard_params]
            try:
                yield
            finally:
                if self._depth == 1:
                    self.masters = [on_disk() for _ in self.shard_params]
        finally:
            self._depth -= 1

    def grad_buffers(self) -> list[torch.Tensor]:
        return []  # the gradients are in the swap file

