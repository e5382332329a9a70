"""``SwappedAdam``: CPU Adam whose moments live in a ``StateSwapper``'s file and stream through its
host buffers while the step runs (ZeRO-Infinity's ``infinity.InfinityAdam`` swaps the masters
and their gradients with them).

With ``offload_optimizer.device = "nvme"`` the placement (``placement.py``) replaces the wrapped
CPUAdam by this one. Per chunk of ``sub_group_size`` elements the step reads the record ahead,
runs the compiled Adam kernel on it and writes it back behind (``StateSwapper.stream``).

Its chunks are its pieces (``piece_bounds``): on a device with side streams the step goes in pieces
(``step_pipeline.py``), ``step_pieces`` taking the chunks in the order their gradients land, in one
stream (the reads ahead go on from piece to piece): per chunk the pipeline's ``begin`` waits for that
chunk's gradient, scales and clips it and gives the staging the kernel writes the compute-dtype
parameters into, and its ``end`` sends them up while the next chunk is stepped. A step taken whole is
the same loop in parameter order, ``begin`` giving the copy-out target.

bf16 masters (``bf16.bf16_master_weights_and_grads``) step on ``adam_step_bf16_`` with the rounding,
key and element index ``CPUAdam`` gives them in memory, over moments of the swapper's dtype (bf16 with
``bf16_optimizer_states``): the same bits as the in-memory and CPU-offload steps. Kahan's
compensation stays in memory beside the master here (``state[p]["compensation"]``); ZeRO-Infinity
keeps it in the record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Callable, Optional, Sequence

import torch

from ..ops.adam import COMPENSATION, CPUAdam, adam_step_
from ..ops.adam_bf16 import LOW_MASTER_DTYPES, adam_step_bf16_
from ..ops.shard_optimizer import ShardPiece, clip_runs
from .state_swap import Chunk, StateSwapper, check_intact


class SwappedAdam(CPUAdam):
    """``CPUAdam`` whose ``exp_avg``/``exp_avg_sq`` live in a ``StateSwapper``'s file.

    ``state[p]`` keeps only ``step`` between steps. ``states_in_memory()`` brings the moments
    into ``state[p]`` as ordinary tensors (for checkpoints) and puts them back on exit.
    """

    compensation_in_memory = (
        True  # Kahan's, beside the master in memory (InfinityAdam: in the record)
    )
    steps_in_pieces = True  # step_pieces: its chunks, in one swap stream (read-ahead goes on)

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

    def piece_bounds(self, param: torch.Tensor, size: int) -> list[tuple[int, int]]:
        """ShardOptimizer: its pieces are the swap file's chunks of ``param`` (``size`` aside)."""
        return [(c.lo, c.hi) for c in self.swapper.chunks[self._index[id(param)]]]

    def step_pieces(self, pieces, runs, begin, end) -> None:
        """ShardOptimizer: the step over ``runs`` in one swap stream over the chunks, in the order of
        ``pieces`` (``piece_bounds``): the moments are read ahead across pieces as in a step taken
        whole; ``begin`` and ``end`` run around each chunk's Adam."""
        self._runs = {id(p): list(r) for p, r in runs.items()}
        try:
            self._step_chunks(pieces, begin, end)
        finally:
            self._runs = {}

    def _step(self, closure, copy_out_by_id: Mapping[int, torch.Tensor]):
        loss = self._run_closure(closure)
        chunks = [ShardPiece(p, c.lo, c.hi) for i, p in enumerate(self._params)
                  for c in self.swapper.chunks[i]]  # fmt: skip
        self._step_chunks(chunks, lambda piece: copy_out_by_id.get(id(piece.param)), _no_end)
        return loss

    def _step_chunks(
        self,
        pieces: Sequence[ShardPiece],
        begin: Callable[[ShardPiece], Optional[torch.Tensor]],
        end: Callable[[ShardPiece], None],
    ) -> None:
        """One step over the chunks ``pieces`` names, in that order (``step_pieces``' ``begin``/``end``
        around each): the due parameters' in one swap stream, the others' (no gradient) only through
        ``begin``/``end``; step counts, Kahan's compensation and ``_on_disk`` as a whole step leaves them."""
        check_intact(self.swapper.file)
        due = {}
        for group, param, state, runs in self._due():
            if self._compensated(param):
                state.setdefault(COMPENSATION, torch.zeros_like(param))
            due[self._index[id(param)]] = (self._hyper(group), runs, param)
        jobs = []
        for piece in pieces:
            i = self._index[id(piece.param)]
            if i in due:
                jobs.append((self.swapper.chunk_at(i, piece.lo), piece))
            else:  # nothing to step: the piece still goes through the caller's hooks
                begin(piece)
                end(piece)
        self._stream_step(due, jobs, begin, end)
        self._on_disk.update(due)

    def _stream_step(self, due: dict, jobs: list, begin, end) -> None:
        """Adam over ``jobs`` ((chunk, its piece) each) with the moments streamed through the buffers;
        parameters in memory. Only the runs are stepped, each at its own step number; the rest of a
        chunk goes back as it came."""
        piece_of = dict(jobs)  # chunk -> the caller's piece

        def compute(c: Chunk, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
            hyper, runs, param = due[c.index]
            piece = piece_of[c]
            out = begin(piece)  # (its gradient landed, scaled and clipped)
            comp = self.state[param].get(COMPENSATION)
            for lo, hi, step in clip_runs(runs, c.lo, c.hi):
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
            end(piece)

        chunks = [c for c, _ in jobs]
        self.swapper.stream(chunks, lambda c: c.index not in self._on_disk, compute)

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


def _no_end(piece: ShardPiece) -> None:
    """A step taken whole: nothing to do after a chunk."""
