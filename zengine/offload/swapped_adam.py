"""``SwappedAdam``: CPU Adam whose moments live in a ``StateSwapper``'s file and stream through its
host buffers while the step runs (ZeRO-Infinity's ``infinity.InfinityAdam`` swaps the fp32 masters
and their gradients with them).

With ``offload_optimizer.device = "nvme"`` the placement (``placement.py``) replaces the wrapped
CPUAdam by this one. Per chunk of ``sub_group_size`` elements the step reads the record ahead,
runs the compiled Adam kernel on it and writes it back behind (``StateSwapper.stream``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
import torch

from ..ops.adam import CPUAdam, adam_step_
from .state_swap import Chunk, StateSwapper, check_intact


class SwappedAdam(CPUAdam):
    """``CPUAdam`` whose ``exp_avg``/``exp_avg_sq`` live in a ``StateSwapper``'s file.

    ``state[p]`` keeps only ``step`` between steps. ``states_in_memory()`` brings the moments
    into ``state[p]`` as ordinary tensors (for checkpoints) and puts them back on exit.
    """

    steps_in_pieces = (
        False  # its step streams the moments chunk by chunk from the file: one call per step
    )

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
            raise ValueError(
                f"offload_optimizer.device 'nvme' swaps Adam's moments and needs CPUAdam: optimizer.type "
                f"Adam, AdamW or CPUAdam in the config, or a zengine.ops.CPUAdam passed as the client "
                f"optimizer; got {type(optimizer).__name__}"
            )
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
            for lo, hi, step in run_overlaps(runs, c.lo, c.hi):
                a, b = lo - c.lo, hi - c.lo
                adam_step_(
                    param.data[lo:hi],
                    param.grad[lo:hi],
                    exp_avg[a:b],
                    exp_avg_sq[a:b],
                    step=step,
                    copy_out=out.view(-1)[lo:hi] if out is not None else None,
                    **hyper,
                )

        self.swapper.stream(jobs, lambda c: c.index not in self._on_disk, compute)

    @contextlib.contextmanager
    def states_in_memory(self):
        """Inside: ``state[p]`` holds ``exp_avg``/``exp_avg_sq`` as whole tensors (read from the file);
        on exit whatever they hold then is written back and dropped from memory."""
        for i in sorted(self._on_disk):
            p = self._params[i]
            m, v = torch.empty_like(p.data), torch.empty_like(p.data)

            def take(c, exp_avg, exp_avg_sq, m=m, v=v):
                m[c.lo : c.hi].copy_(exp_avg)
                v[c.lo : c.hi].copy_(exp_avg_sq)

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
                    exp_avg.copy_(m[c.lo : c.hi])
                    exp_avg_sq.copy_(v[c.lo : c.hi])

                self.swapper.stream(self.swapper.chunks[i], lambda c: True, put)
                self._on_disk.add(i)
                state.setdefault("step", torch.tensor(0.0))

    def close(self) -> None:
        """Release the swap file and its I/O threads; the optimizer cannot step after this."""
        self.swapper.close()

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory the moments take: the swap buffers."""
        return list(self.swapper.buffers)


def run_overlaps(runs, lo: int, hi: int):
    """The parts of runs (a, b, step number) inside [lo, hi)."""
    for a, b, step in runs:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            yield a, b, step
