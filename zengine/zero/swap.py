"""NVMe offload of the optimizer states: Adam's moments live in a swap file and stream
through a few host buffers while the step runs.

``offload_optimizer: {device: nvme, nvme_path: DIR}`` keeps the fp32 master shard and its
gradient in host memory (as with ``cpu``) and moves ``exp_avg`` and ``exp_avg_sq`` — two
thirds of the 12 bytes per parameter of optimizer state — to a file under ``DIR``. The step
walks the shard in chunks of ``sub_group_size`` elements (at most ``MAX_CHUNK``), through
``buffer_count`` host buffers (pinned with ``pin_memory`` on a GPU machine):

    read chunk k+ahead  |  CPUAdam on chunk k (writes the compute-dtype params too)  |  write chunk k-1

so the drive and the kernel work at the same time and host memory holds ``buffer_count``
chunks of moments instead of the whole shard's. The file lives in a file per rank, unlinked
when opened, so nothing is left behind however the process ends.

Layout: for each parameter (a flat master shard), its chunks back to back; a chunk of ``n``
elements takes ``2 * pad(n)`` fp32 in the file and in a buffer, ``[exp_avg | exp_avg_sq]``,
``pad`` rounding up to whole ``ALIGN`` blocks so that ``O_DIRECT`` I/O is aligned.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..ops.adam import CPUAdam, adam_step_
from ..ops.aio import ALIGN, AsyncIO, IORequest, SwapFile, aligned_empty

MAX_CHUNK = 1 << 24  # elements; 4 buffers of this size hold 512 MiB of moments
_ALIGN_ELEMS = ALIGN // 4  # fp32 elements per aligned block


def _pad(n: int) -> int:
    return -(-n // _ALIGN_ELEMS) * _ALIGN_ELEMS


@dataclass(frozen=True)
class Chunk:
    """Elements [lo, hi) of parameter ``index``; its moments at byte ``offset`` of the swap file."""

    index: int
    lo: int
    hi: int
    offset: int

    @property
    def padded(self) -> int:
        return _pad(self.hi - self.lo)


class StateSwapper:
    """The swap file and host buffers for the moments of a list of flat fp32 parameters."""

    def __init__(self, numels: list[int], directory: str, chunk: int, buffer_count: int, io: AsyncIO,
                 pin: bool = False):
        if buffer_count < 2:
            raise ValueError("offload_optimizer.buffer_count: NVMe swapping needs at least 2 buffers")
        self.chunk = _pad(max(1, min(int(chunk), MAX_CHUNK)))
        self.io = io
        self.chunks: list[list[Chunk]] = []
        offset = 0
        for index, n in enumerate(numels):
            mine = []
            for lo in range(0, n, self.chunk):
                c = Chunk(index, lo, min(n, lo + self.chunk), offset)
                mine.append(c)
                offset += 2 * c.padded * 4
            self.chunks.append(mine)
        self.file = SwapFile(directory, max(offset, ALIGN))
        biggest = max((c.padded for cs in self.chunks for c in cs), default=_ALIGN_ELEMS)
        count = min(buffer_count, max(2, sum(len(cs) for cs in self.chunks)))
        # [2 * biggest chunk] fp32 each: exp_avg then exp_avg_sq of the chunk in hand
        self.buffers = [aligned_empty(2 * biggest, torch.float32, pin) for _ in range(count)]

    def _view(self, slot: int, c: Chunk) -> torch.Tensor:
        return self.buffers[slot][:2 * c.padded]

    def moments(self, slot: int, c: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of chunk ``c`` in buffer ``slot``: [hi - lo] fp32 views."""
        buf = self._view(slot, c)
        n = c.hi - c.lo
        return buf[:n], buf[c.padded:c.padded + n]

    def stream(self, chunks: list[Chunk], fresh: Callable[[Chunk], bool],
               compute: Callable[[Chunk, torch.Tensor, torch.Tensor], None], write: bool = True) -> None:
        """Run ``compute(chunk, exp_avg, exp_avg_sq)`` over ``chunks`` with reads ahead and writes behind.

        A chunk for which ``fresh`` is true starts from zeros instead of being read; with ``write``
        each chunk is written back after its compute.
        """
        count = len(self.buffers)
        ahead = max(1, count - 2)  # reads in flight beyond the chunk in hand; one write stays in flight too
        reads: dict[int, Optional[IORequest]] = {}
        writes: dict[int, IORequest] = {}  # slot -> the last write from it
        nxt = 0

        def launch(k: int) -> None:
            slot, c = k % count, chunks[k]
            pending = writes.pop(slot, None)
            if pending is not None:
                pending.wait()
            if fresh(c):
                self._view(slot, c).zero_()
                reads[k] = None
            else:
                reads[k] = self.io.read(self._view(slot, c), self.file, c.offset)

        try:
            for k, c in enumerate(chunks):
                while nxt < len(chunks) and nxt <= k + ahead:
                    launch(nxt)
                    nxt += 1
                request = reads.pop(k)
                if request is not None:
                    request.wait()
                slot = k % count
                compute(c, *self.moments(slot, c))
                if write:
                    writes[slot] = self.io.write(self._view(slot, c), self.file, c.offset)
        finally:  # also after an error: no request may outlive the buffers it uses
            for request in list(reads.values()) + list(writes.values()):
                if request is not None:
                    request.wait()

    def close(self) -> None:
        """Stop the I/O threads and close the swap file (the moments are gone after this)."""
        self.io.close()
        self.file.close()


class SwappedAdam(CPUAdam):
    """``CPUAdam`` whose ``exp_avg``/``exp_avg_sq`` live in a ``StateSwapper``'s file.

    ``state[p]`` keeps only ``step`` between steps. ``states_in_memory()`` brings the moments
    into ``state[p]`` as ordinary tensors (for checkpoints) and puts them back on exit.
    """

    def __init__(self, param_groups, defaults: dict, swapper_for: Callable[[list[int]], StateSwapper]):
        super().__init__(param_groups, **defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.swapper = swapper_for([p.numel() for p in self._params])
        self._on_disk: set[int] = set()  # indices of parameters whose moments the file holds
        self._keep: dict[int, list[tuple[int, int]]] = {}

    @classmethod
    def replacing(cls, optimizer: torch.optim.Optimizer, swapper_for) -> "SwappedAdam":
        """A SwappedAdam with ``optimizer``'s groups and hyper-parameters (it must be a CPUAdam)."""
        if not isinstance(optimizer, CPUAdam):
            raise ValueError(f"offload_optimizer.device 'nvme' swaps Adam's moments and needs CPUAdam: optimizer.type "
                             f"Adam, AdamW or CPUAdam in the config, or a zengine.ops.CPUAdam passed as the client "
                             f"optimizer; got {type(optimizer).__name__}")
        return cls(optimizer.param_groups, optimizer.defaults, swapper_for)

    def keep_unchanged(self, param: torch.Tensor, lo: int, hi: int) -> None:
        """This step must leave the moments of ``param[lo:hi]`` as they are (nobody used those elements)."""
        self._keep.setdefault(self._index[id(param)], []).append((lo, hi))

    def _step(self, closure, copy_out_by_id: Mapping[int, torch.Tensor]):
        loss = self._run_closure(closure)
        due, jobs = {}, []
        for group, param, _, step in self._due():
            i = self._index[id(param)]
            due[i] = (self._hyper(group), step, param, copy_out_by_id.get(id(param)))
            jobs += self.swapper.chunks[i]
        keep, self._keep = self._keep, {}

        def compute(c: Chunk, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
            hyper, step, param, out = due[c.index]
            saved = [(lo, hi, exp_avg[lo - c.lo:hi - c.lo].clone(), exp_avg_sq[lo - c.lo:hi - c.lo].clone())
                     for lo, hi in _overlaps(keep.get(c.index, ()), c.lo, c.hi)]
            adam_step_(param.data[c.lo:c.hi], param.grad[c.lo:c.hi], exp_avg, exp_avg_sq, step=step,
                       copy_out=out.view(-1)[c.lo:c.hi] if out is not None else None, **hyper)
            for lo, hi, m, v in saved:
                exp_avg[lo - c.lo:hi - c.lo].copy_(m)
                exp_avg_sq[lo - c.lo:hi - c.lo].copy_(v)

        self.swapper.stream(jobs, lambda c: c.index not in self._on_disk, compute)
        self._on_disk.update(due)
        return loss

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


def _overlaps(ranges, lo: int, hi: int):
    for a, b in ranges:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            yield a, b
