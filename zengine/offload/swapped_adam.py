"""``SwappedAdam``: CPU Adam whose moments live in a ``StateSwapper``'s file and stream through its
host buffers while the step runs (ZeRO-Infinity's ``infinity.InfinityAdam`` swaps the masters
and their gradients with them).

With ``offload_optimizer.device = "nvme"`` the placement (``placement.py``) replaces the wrapped
CPUAdam by this one. Per chunk of ``sub_group_size`` elements the step reads the record ahead,
runs the compiled Adam kernel on it and writes it back behind (``StateSwapper.stream``).

bf16 masters (``bf16.bf16_master_weights_and_grads``) step on ``adam_step_bf16_`` with the rounding,
key and element index ``CPUAdam`` gives them in memory, over moments of the swapper's dtype (bf16 with
``bf16_optimizer_states``): the same bits as the in-memory and CPU-offload steps. Kahan's
compensation stays in memory beside the master here (``state[p]["compensation"]``); ZeRO-Infinity
keeps it in the record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
import torch

from ..ops.adam import COMPENSATION, CPUAdam, adam_step_
from ..ops.adam_bf16 import LOW_MASTER_DTYPES, adam_step_bf16_
from .state_swap import Chunk, StateSwapper, check_intact


class SwappedAdam(CPUAdam):
    """``CPUAdam`` whose ``exp_avg``/``exp_avg_sq`` live in a ``StateSwapper``'s file.

    ``state[p]`` keeps only ``step`` between steps. ``states_in_memory()`` brings the moments
    into ``state[p]`` as ordinary tensors (for checkpoints) and puts them back on exit.
    """

    compensation_in_memory = (
        True  # Kahan's, beside the master in memory (InfinityAdam: in the record)
    )
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
        swapped = cls(optimizer.param_groups, optimizer.defaults, *args)
        # bf16 masters: the moments' dtype, the rounding and its seed (not among the defaults)
        swapped.bf16_states, swapped.rounding = optimizer.bf16_states, optimizer.rounding
        swapped.seed = optimizer.seed
        return swapped

    def _step(self, closure, copy_out_by_id: Mapping[int, torch.Tensor]):
        check_intact(self.swapper.file)
        loss = self._run_closure(closure)
        due, jobs = {}, []
        for group, param, state, runs in self._due():
            if self._compensated(param):
                state.setdefault(COMPENSATION, torch.zeros_like(param))
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
            comp = self.state[param].get(COMPENSATION)
            for lo, hi, step in run_overlaps(runs, c.lo, c.hi):
                a, b = lo - c.lo, hi - c.lo
                self.adam_range(
                    param,
                    lo,
                    step,
                    hyper,
                    param.data[lo:hi],
                    param.grad[lo:hi],
                    exp_avg[a:b],
                    exp_avg_sq[a:b],
                    comp[lo:hi] if comp is not None else None,
                    out.view(-1)[lo:hi] if out is not None else None,
                )

        self.swapper.stream(jobs, lambda c: c.index not in self._on_disk, compute)

    def _compensated(self, param: torch.Tensor) -> bool:
        """``param`` keeps Kahan's compensation in ``state`` (a bf16 master, Kahan rounding)."""
        low = param.dtype == torch.bfloat16  # (fp16 masters round to nearest: no compensation)
        return self.compensation_in_memory and low and bool(self.rounding.buffers)

    def adam_range(self, param, lo: int, step: int, hyper: dict, p, g, m, v, comp, out) -> None:
        """Adam on elements [lo, lo + len(p)) of ``param`` (``p``: the master's values there, fp32 or
        bf16; ``comp``: Kahan's compensation or None; ``out``: where the updated values also go, or
        None), with the arithmetic and rounding ``CPUAdam`` steps that parameter with in memory."""
        if p.dtype not in LOW_MASTER_DTYPES:
            adam_step_(p, g, m, v, step=step, copy_out=out, **hyper)
            return
        adam_step_bf16_(
            p,
            g,
            m,
            v,
            step=step,
            compensation=comp,
            rounding=self.rounding,
            key=self._key(param, step),
            first_index=lo,
            **hyper,
        )
        if out is not None:
            out.copy_(p.reshape(out.shape))

    @contextlib.contextmanager
    def states_in_memory(self):
        """Inside: ``state[p]`` holds ``exp_avg``/``exp_avg_sq`` as whole tensors (read from the file);
        on exit whatever they hold then is written back and dropped from memory."""
        for i in sorted(self._on_disk):
            p = self._params[i]
            states = self.swapper.dtypes[0]
            m, v = torch.empty_like(p.data, dtype=states), torch.empty_like(p.data, dtype=states)

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
                if self._compensated(p):
                    state.setdefault(COMPENSATION, torch.zeros_like(p))

                def put(c, exp_avg, exp_avg_sq, m=m, v=v):
                    exp_avg.copy_(m[c.lo : c.hi])
                    exp_avg_sq.copy_(v[c.lo : c.hi])

                self.swapper.stream(self.swapper.chunks[i], lambda c: True, put)
                self._on_disk.add(i)
                state.setdefault("step", torch.tensor(0.0))

    def close(self) -> None:
        """Release the swap file and its I/O threads; the optimizer cannot step after this."""
        self.swapper.close()

    def swap_bytes(self) -> int:
        """Bytes of the swap file: its records (``StateSwapper.bytes_per_element`` per element, padded)."""
        return self.swapper.file.size

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory the moments take: the swap buffers."""
        return list(self.swapper.buffers)


def run_overlaps(runs, lo: int, hi: int):
    """The parts of runs (a, b, step number) inside [lo, hi)."""
    for a, b, step in runs:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            yield a, b, step
