"""ZeRO-Infinity's optimizer side at stage 3: its optimizer, master store, gradient sink and the
chunk I/O the NVMe-swapped step needs from the groups.

With ``offload_optimizer.device = "nvme"`` at stage 3 (``placement.InfinityPlacement``) the
masters (fp32, or bf16 with ``bf16_master_weights_and_grads``) and the gradient shards are swapped with Adam's moments, so host memory for the optimizer
is the swap buffers. The placement builds the parts that go with it, all here:

- ``InfinityAdam``, the optimizer: ``swapped_adam.SwappedAdam`` over a record ``[exp_avg |
  exp_avg_sq | master | grad]`` per chunk (``record_dtypes``: fp32 parts, or with bf16 masters
  the master and gradient in bf16 and the moments in the states' dtype, Kahan's compensation a
  part of its own before the gradient: 8 bytes per parameter with bf16 states, 10 with Kahan);
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

from ..ops.adam import COMPENSATION
from ..ops.shard_optimizer import clip_runs
from .copies import HostCopies
from .param_swap import align_elems, on_disk
from .state_swap import Chunk, GradSwap, StateSwapper, check_intact
from .swapped_adam import SwappedAdam

if TYPE_CHECKING:  # offload/ never imports zero/ at run time (zero/ builds on offload/)
    from ..zero.masters import GradientReader
    from ..zero.shard_step import ShardStepper
    from ..zero.stage3.group import ShardedParamGroup
    from ..zero.step_counts import Plan
    from .placement import NVMePlacement

G = TypeVar("G")


def record_dtypes(master: torch.dtype, states: torch.dtype, kahan: bool) -> tuple:
    """The parts of a ZeRO-Infinity record: ``[exp_avg | exp_avg_sq | master | grad]``, with Kahan's
    compensation (``kahan``) before the gradient, which stays last (``GradSwap``). The master in the
    record even where the parameters are bf16 too: it is read and written with the moments, while
    the parameters live where ``offload_param`` puts them (device, host or their own file)."""
    return (states, states, master) + ((master,) if kahan else ()) + (master,)


class MasterIO:
    """Reads and writes a stage-3 group's compute-dtype shard by chunk, wherever it lives;
    ``copies`` (``copies.py``) moves the chunks of a shard on the device, without the host waiting
    for each."""

    def __init__(
        self,
        groups: list["ShardedParamGroup"],
        dtype: torch.dtype,
        copies: Optional[HostCopies] = None,
    ):
        self.groups = groups
        self.align = align_elems(dtype)
        # the masters' sizes (their tensors are empty in memory)
        self.numels = [g.shard_numel for g in groups]
        self._resident = [g.resident() if not g.in_memory else [] for g in groups]
        self.copies = copies if copies is not None else HostCopies()
        self._landings: list = []  # init_master copies from the device not yet waited for

    def init_master(self, index: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` ([hi - lo], the masters' dtype) from group ``index``'s parameters; read it after
        ``ready()``."""
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
        """Group ``index``'s parameters [lo, hi) from the updated ``master`` chunk (which may be
        rewritten as soon as this returns)."""
        g = self.groups[index]
        if g.in_memory:
            self.copies.upload(g.shard_flat[lo:hi], master)
        else:
            g.swap.write_range(g.base, lo, hi, master, self._resident[index])

    def flush(self) -> None:
        """Every parameter write has landed (the next gather may read them)."""
        for swap in {id(g.swap): g.swap for g in self.groups if not g.in_memory}.values():
            swap.flush()


class InfinityAdam(SwappedAdam):
    """ZeRO-Infinity's optimizer: ``SwappedAdam`` whose records hold the masters and their
    gradients too, ``[exp_avg | exp_avg_sq | master | grad]`` per chunk (``record_dtypes``).

    The parameters it steps (the flat master shards) have no storage except inside
    ``states_in_memory``; ``masters_io`` (``infinity.MasterIO``) reads a never-stepped chunk's
    master from the compute-dtype parameters and writes each updated chunk back to them. The
    gradients arrive in the file through ``grads`` (a ``GradSwap`` on the same swapper) during
    backward; the step multiplies them by ``grad_scale`` (the gradient factor's unscale), then by
    ``clip_coef`` when the norm is clipped, in that order as the in-memory master gradients are
    (each multiplication rounds in the gradients' dtype), set through the master store
    (``SwappedMasters``) before it runs.
    """

    compensation_in_memory = False  # Kahan's compensation is a part of the record
    # its gradients are in the records, whose sums of squares (the norm) need every piece written:
    # the step starts after they all landed (SwappedMasterGrads.sq_norm), and is taken whole
    steps_in_pieces = False

    def __init__(
        self, param_groups, defaults: dict, swapper: StateSwapper, masters_io, grads: GradSwap
    ):
        super().__init__(param_groups, defaults, swapper)
        self.masters_io = masters_io
        self.grads = grads
        self.grad_scale = 1.0
        self.clip_coef: Optional[float] = None
        self._resident = False  # inside states_in_memory
        self._kahan = swapper.parts == 5  # Kahan's compensation is part 3 (record_dtypes)
        self._last = swapper.parts - 1  # the gradient's part, and how many parts precede it

    def _stream_step(self, due: dict, jobs: list, begin, end) -> None:
        """Per chunk (``jobs``: (chunk, its piece) each): read the whole record (the gradient only, the
        master from the parameters, for a chunk never stepped), Adam, write the compute-dtype
        parameters (``masters_io``: no copy-out target, ``begin`` gives None) and [exp_avg |
        exp_avg_sq | master] back."""
        piece_of = dict(jobs)
        self.grads.flush()
        check_intact(self.swapper.file)
        scale, coef, part, last = self.grad_scale, self.clip_coef, self.swapper.part, self._last

        def compute(c: Chunk, slot: int) -> None:
            hyper, runs, param = due[c.index]
            begin(piece_of[c])
            # a chunk never stepped: its master has come from the parameters
            self.masters_io.ready()
            exp_avg, exp_avg_sq, master = (part(slot, c, k) for k in range(3))
            comp, grad = part(slot, c, 3) if self._kahan else None, part(slot, c, last)
            for a, b in self.grads.gaps(c):  # never written this window: no gradient
                grad[a - c.lo : b - c.lo].zero_()
            if scale != 1.0:
                grad.mul_(scale)
            if coef is not None:
                grad.mul_(coef)
            for lo, hi, step in clip_runs(runs, c.lo, c.hi):
                a, b = lo - c.lo, hi - c.lo
                k = comp[a:b] if comp is not None else None
                self.adam_range(
                    param,
                    lo,
                    step,
                    hyper,
                    master[a:b],
                    grad[a:b],
                    exp_avg[a:b],
                    exp_avg_sq[a:b],
                    k,
                    None,
                )
            self.masters_io.params_out(c.index, c.lo, c.hi, master)
            end(piece_of[c])

        try:
            self.swapper.stream(
                [c for c, _ in jobs],
                lambda c: c.index not in self._on_disk,
                compute,
                parts_in=last + 1,
                fresh_in=last,
                fresh_fill=self._fill_master,
                parts_out=last,
                with_slot=True,
            )
        finally:
            self.masters_io.flush()

    def _fill_master(self, c: Chunk, slot: int) -> None:
        """A chunk never stepped: its master from the compute-dtype parameters."""
        self.masters_io.init_master(c.index, c.lo, c.hi, self.swapper.part(slot, c, 2))

    @contextlib.contextmanager
    def states_in_memory(self):
        """As SwappedAdam's; the parameters (the masters) get their storage and values for the
        duration too. Re-entrant (a checkpoint calling safe_get_full_* inside)."""
        if self._resident:
            yield
            return
        self._resident = True
        try:
            with self._records_in_memory():
                yield
        finally:
            self._resident = False

    @contextlib.contextmanager
    def _records_in_memory(self):
        states, master, last = self.swapper.dtypes[0], self.swapper.dtypes[2], self._last
        for i, p in enumerate(self._params):
            p.data = torch.empty(self.masters_io.numels[i], dtype=master, device="cpu")
            stepped = i in self._on_disk
            m, v, comp = (None, None, None)
            if stepped:
                m, v = (
                    torch.empty_like(p.data, dtype=states),
                    torch.empty_like(p.data, dtype=states),
                )
                comp = torch.empty_like(p.data) if self._kahan else None

            def take(c, slot, p=p, m=m, v=v, comp=comp):
                self.masters_io.ready()
                p.data[c.lo : c.hi].copy_(self.swapper.part(slot, c, 2))
                for k, t in ((0, m), (1, v), (3, comp)):
                    if t is not None:
                        t[c.lo : c.hi].copy_(self.swapper.part(slot, c, k))

            self.swapper.stream(
                self.swapper.chunks[i],
                lambda c: not stepped,
                take,
                write=False,
                parts_in=last,
                fresh_in=last,
                fresh_fill=self._fill_master,
                with_slot=True,
            )
            if m is not None:
                self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"] = m, v
            if comp is not None:
                self.state[p][COMPENSATION] = comp
        try:
            yield
        finally:
            for i, p in enumerate(self._params):
                state = self.state.get(p, {})
                m, v = state.pop("exp_avg", None), state.pop("exp_avg_sq", None)
                comp = state.pop(COMPENSATION, None)
                parts = (m, v, p.data) + ((comp,) if self._kahan else ())

                def put(c, slot, p=p, parts=parts):
                    for k, t in enumerate(parts):
                        if t is None:
                            self.swapper.part(slot, c, k).zero_()
                        else:
                            self.swapper.part(slot, c, k).copy_(t[c.lo : c.hi])
                    self.masters_io.params_out(c.index, c.lo, c.hi, p.data[c.lo : c.hi])

                try:
                    self.swapper.stream(
                        self.swapper.chunks[i],
                        lambda c: True,
                        put,
                        parts_in=0,
                        fresh_in=0,
                        parts_out=last,
                        with_slot=True,
                    )
                finally:
                    self.masters_io.flush()
                self._on_disk.add(i)
                p.data = torch.empty(0, dtype=master, device="cpu")

    def close(self) -> None:
        self.grads.flush()
        super().close()


class SwappedMasterGrads:
    """The master gradients in the swap records: their scale and clip coefficient become
    ``InfinityAdam.grad_scale``, applied chunk by chunk in the step."""

    def __init__(
        self,
        adam: InfinityAdam,
        sink: GradSwap,
        grads: "GradientReader",
        count: int,
        copies: HostCopies,
    ):
        # what the step's .grad shows, in the masters' dtype
        self.tensors = [on_disk(sink.dtype) for _ in range(count)]
        adam.clip_coef = None  # a new step: no clip yet
        self._adam, self._sink, self._grads, self._copies = adam, sink, grads, copies

    def sq_norm(self) -> torch.Tensor:
        self._sink.flush()  # every piece copied down and summed
        return self._grads.swapped_sq() * self._adam.grad_scale**2  # (before any clip)

    def clip(self, coef: float) -> None:
        self._adam.clip_coef = coef

    def nonfinite_search(self) -> list[torch.Tensor]:
        """The gradient shards as the gradient store reads them back from the file."""
        self._copies.settle()
        return [self._grads.owned_grad(gi) for gi in range(len(self.tensors))]

    def step(
        self, stepper: "ShardStepper", plans: list["Plan"], owned: Mapping[int, torch.Tensor]
    ) -> None:
        stepper.step(plans, owned)


class SwappedMasters:
    """ZeRO-Infinity's master store: masters and their gradients in the optimizer's swap records."""

    def __init__(
        self, groups: list["ShardedParamGroup"], dtype: torch.dtype, home: "NVMePlacement"
    ):
        self.io = MasterIO(groups, dtype, home.copies)
        self.copies = home.copies
        # records [exp_avg | exp_avg_sq | master | grad] per chunk, aligned as the parameter shards
        self.swapper = home.swapper(self.io.numels, home.record_dtypes(), self.io.align)
        # where the gradient store writes reduced buckets
        self.sink = GradSwap(self.swapper, home.copies)
        # in the swap file; values only inside resident()
        self.dtype = home.master_dtype  # fp32, or bf16 with bf16 masters
        self.masters = [on_disk(self.dtype) for _ in groups]
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
                    self.masters = [on_disk(self.dtype) for _ in self.shard_params]
        finally:
            self._depth -= 1

    def grad_buffers(self) -> list[torch.Tensor]:
        return []  # the gradients are in the swap file
