"""``SwappedAdam``: CPU Adam whose moments (and, with ZeRO-Infinity, the fp32 masters and their
gradients) live in a ``StateSwapper``'s file and stream through its host buffers while the step runs.

With ``offload_optimizer.device = "nvme"`` the placement (``placement.py``) replaces the wrapped
CPUAdam by this one. Per chunk of ``sub_group_size`` elements the step reads the record ahead,
runs the compiled Adam kernel on it and writes it back behind (``StateSwapper.stream``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
import torch

from ..ops.adam import CPUAdam, adam_step_
from .state_swap import Chunk, GradSwap, StateSwapper, check_intact


class SwappedAdam(CPUAdam):
    """``CPUAdam`` whose ``exp_avg``/``exp_avg_sq`` live in a ``StateSwapper``'s file.

    ``state[p]`` keeps only ``step`` between steps. ``states_in_memory()`` brings the moments
    into ``state[p]`` as ordinary tensors (for checkpoints) and puts them back on exit.
    """

    steps_in_pieces = False  # its step streams the moments chunk by chunk from the file: one call per step

    def __init__(self, param_groups, defaults: dict, swapper: StateSwapper):
        super().__init__(param_groups, **defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.swapper = swapper  # its records are laid out for self._params, in this order
        self._on_disk: set[int] = set()  # indices of parameters whose moments the file holds

    @classmethod
    def replacing(cls, optimizer: torch.optim.Optimizer, *args) -> "SwappedAdam":
        """One with ``optimizer``'s groups and hyper-parameters (it must be a CPUAdam), and ``args`` after."""
        if not isinstance(optimizer, CPUAdam):
            raise ValueError(f"offload_optimizer.device 'nvme' swaps Adam's moments and needs CPUAdam: optimizer.type "
                             f"Adam, AdamW or CPUAdam in the config, or a zengine.ops.CPUAdam passed as the client "
                             f"optimizer; got {type(optimizer).__name__}")
        return cls(optimizer.param_groups, optimizer.defaults, *args)

    def _step(self, closure, copy_out_by_id: Mapping[int, torch.Tensor]):
        check_intact(self.swapper.file)
        loss = self._run_closure(closure)
        due, jobs = {}, []
        for group, param, _, runs in self._due():
            i = self._index[id(param)]
            due[i] = (self._hyper(group), runs, param, copy_out_by_id.get(id(param)))
            jobs += self.swapper.chunks[i]
        self._stream_step(due, jobs)
        self._on_disk.update(due)
        return loss

    def _stream_step(self, due: dict, jobs: list[Chunk]) -> None:
        """Adam over ``jobs`` with the moments streamed through the buffers; parameters in memory. Only the
        runs are stepped, each at its own step number; the rest of a chunk goes back as it came."""
        def compute(c: Chunk, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
            hyper, runs, param, out = due[c.index]
            for lo, hi, step in _overlaps(runs, c.lo, c.hi):
                a, b = lo - c.lo, hi - c.lo
                adam_step_(param.data[lo:hi], param.grad[lo:hi], exp_avg[a:b], exp_avg_sq[a:b], step=step,
                           copy_out=out.view(-1)[lo:hi] if out is not None else None, **hyper)

        self.swapper.stream(jobs, lambda c: c.index not in self._on_disk, compute)

    @contextlib.contextmanager
    def states_in_memory(self):
        """Inside: ``state[p]`` holds ``exp_avg``/``exp_avg_sq`` as whole tensors (read from the file);
        on exit whatever they hold then is written back and dropped from memory."""
        for i in sorted(self._on_disk):
            p = self._params[i]
            m, v = torch.empty_like(p.data), torch.empty_like(p.data)

            def take(c, exp_avg, exp_avg_sq, m=m, v=v):
                m[c.lo:c.hi].copy_(exp_avg)
                v[c.lo:c.hi].copy_(exp_avg_sq)

            self.swapper.stream(self.swapper.chunks[i], lambda c: False, take, write=False)
            self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"] = m, v
        try:
            yield
        finally:
            self._on_disk.clear()
            for i, p in enumerate(self._params):
                state = self.state.get(p)
                if not state or "exp_avg" not in state:
                    continue
                m, v = state.pop("exp_avg"), state.pop("exp_avg_sq")

                def put(c, exp_avg, exp_avg_sq, m=m, v=v):
                    exp_avg.copy_(m[c.lo:c.hi])
                    exp_avg_sq.copy_(v[c.lo:c.hi])

                self.swapper.stream(self.swapper.chunks[i], lambda c: True, put)
                self._on_disk.add(i)
                state.setdefault("step", torch.tensor(0.0))

    def close(self) -> None:
        """Release the swap file and its I/O threads; the optimizer cannot step after this."""
        self.swapper.close()

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory the moments take: the swap buffers."""
        return list(self.swapper.buffers)


class InfinityAdam(SwappedAdam):
    """ZeRO-Infinity's optimizer: ``SwappedAdam`` whose records hold the fp32 masters and their
    gradients too, ``[exp_avg | exp_avg_sq | master | grad]`` per chunk (a swapper of 4 parts).

    The parameters it steps (the flat master shards) have no storage except inside
    ``states_in_memory``; ``masters_io`` (``infinity.MasterIO``) reads a never-stepped chunk's
    master from the compute-dtype parameters and writes each updated chunk back to them. The
    gradients arrive in the file through ``grads`` (a ``GradSwap`` on the same swapper) during
    backward; the step multiplies them by ``grad_scale`` (the gradient factor's unscale, times the
    clip coefficient), set through the master store (``infinity.SwappedMasters``) before it runs.
    """

    def __init__(self, param_groups, defaults: dict, swapper: StateSwapper, masters_io, grads: GradSwap):
        super().__init__(param_groups, defaults, swapper)
        self.masters_io = masters_io
        self.grads = grads
        self.grad_scale = 1.0
        self._resident = False  # inside states_in_memory

    def _stream_step(self, due: dict, jobs: list[Chunk]) -> None:
        """Per chunk: read the whole record (the gradient only, the master from the parameters, for a
        chunk never stepped), Adam, write the compute-dtype parameters and [exp_avg | exp_avg_sq |
        master] back."""
        self.grads.flush()
        check_intact(self.swapper.file)
        scale, part = self.grad_scale, self.swapper.part

        def compute(c: Chunk, slot: int) -> None:
            hyper, runs, _, _ = due[c.index]
            self.masters_io.ready()  # a chunk never stepped: its master has come from the parameters
            exp_avg, exp_avg_sq, master, grad = (part(slot, c, k) for k in range(4))
            for a, b in self.grads.gaps(c):  # never written this window: no gradient
                grad[a - c.lo:b - c.lo].zero_()
            if scale != 1.0:
                grad.mul_(scale)
            for lo, hi, step in _overlaps(runs, c.lo, c.hi):
                a, b = lo - c.lo, hi - c.lo
                adam_step_(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step=step, **hyper)
            self.masters_io.params_out(c.index, c.lo, c.hi, master)

        try:
            self.swapper.stream(jobs, lambda c: c.index not in self._on_disk, compute, parts_in=4, fresh_in=3,
                                fresh_fill=self._fill_master, parts_out=3, with_slot=True)
        finally:
            self.masters_io.flush()

    def _fill_master(self, c: Chunk, slot: int) -> None:
        """A chunk never stepped: its master from the compute-dtype parameters."""
        self.masters_io.init_master(c.index, c.lo, c.hi, self.swapper.part(slot, c, 2))

    @contextlib.contextmanager
    def states_in_memory(self):
        """As SwappedAdam's; the parameters (the fp32 masters) get their storage and values for the
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
        for i, p in enumerate(self._params):
            p.data = torch.empty(self.masters_io.numels[i], dtype=torch.float32, device="cpu")
            stepped = i in self._on_disk
            m, v = (torch.empty_like(p.data), torch.empty_like(p.data)) if stepped else (None, None)

            def take(c, slot, p=p, m=m, v=v):
                self.masters_io.ready()
                p.data[c.lo:c.hi].copy_(self.swapper.part(slot, c, 2))
                if m is not None:
                    m[c.lo:c.hi].copy_(self.swapper.part(slot, c, 0))
                    v[c.lo:c.hi].copy_(self.swapper.part(slot, c, 1))

            self.swapper.stream(self.swapper.chunks[i], lambda c: not stepped, take, write=False, parts_in=3,
                                fresh_in=3, fresh_fill=self._fill_master, with_slot=True)
            if m is not None:
                self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"] = m, v
        try:
            yield
        finally:
            for i, p in enumerate(self._params):
                state = self.state.get(p, {})
                m, v = state.pop("exp_avg", None), state.pop("exp_avg_sq", None)

                def put(c, slot, p=p, m=m, v=v):
                    for k, t in enumerate((m, v, p.data)):
                        if t is None:
                            self.swapper.part(slot, c, k).zero_()
                        else:
                            self.swapper.part(slot, c, k).copy_(t[c.lo:c.hi])
                    self.masters_io.params_out(c.index, c.lo, c.hi, p.data[c.lo:c.hi])

                try:
                    self.swapper.stream(self.swapper.chunks[i], lambda c: True, put, parts_in=0, fresh_in=0,
                                        parts_out=3, with_slot=True)
                finally:
                    self.masters_io.flush()
                self._on_disk.add(i)
                p.data = torch.empty(0, dtype=torch.float32, device="cpu")

    def close(self) -> None:
        self.grads.flush()
        super().close()


def _overlaps(runs, lo: int, hi: int):
    """The parts of runs (a, b, step) inside [lo, hi)."""
    for a, b, step in runs:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            yield a, b, step
