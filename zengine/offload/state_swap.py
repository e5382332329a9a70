"""The swap file of NVMe-offloaded optimizer states and the host buffers they stream through
(``swapped_adam.SwappedAdam`` is the optimizer that steps them).

``offload_optimizer: {device: nvme, nvme_path: DIR}`` keeps the master shard and its
gradient in host memory (as with ``cpu``) and moves ``exp_avg`` and ``exp_avg_sq`` — two
thirds of the 12 bytes per parameter of optimizer state, or 4 of 8 with bf16 masters and states —
to a file under ``DIR``. The step
walks the shard in chunks of ``sub_group_size`` elements (at most ``MAX_CHUNK``), through
``buffer_count`` host buffers (pinned with ``pin_memory`` on a GPU machine):

    read chunk k+ahead  |  CPUAdam on chunk k (writes the compute-dtype params too)  |  write chunk k-1

so the drive and the kernel work at the same time and host memory holds ``buffer_count``
chunks of moments instead of the whole shard's. The file lives in a file per rank, unlinked
when opened, so nothing is left behind however the process ends.

Layout: for each parameter (a flat master shard), its chunks back to back; a chunk of ``n``
elements takes a record of ``pad(n)`` elements per part, ``[exp_avg | exp_avg_sq]``, each part
in its own dtype (``dtypes``: fp32, or bf16 with ``bf16_optimizer_states``), ``pad`` rounding up
so that every part starts and ends on a whole ``ALIGN`` block (``O_DIRECT`` I/O is aligned in
bytes: 1024 fp32 or 2048 bf16 elements). The host buffers are bytes; ``part`` views a part in
its dtype.
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..ops.aio import ALIGN, AsyncIO, IORequest, SwapFile, aligned_empty
from . import pinned
from .copies import HostCopies

MAX_CHUNK = 1 << 24  # elements; 4 buffers of this size hold 512 MiB of fp32 moments
FP32_PARTS = (torch.float32, torch.float32)  # [exp_avg | exp_avg_sq] of fp32 moments


def host_buffer(
    numel: int, dtype: torch.dtype = torch.float32, pin: bool = False, kind: str = pinned.SWAP
) -> torch.Tensor:
    """An aligned host buffer for swap I/O, in host memory even inside a ``torch.device(...)`` context
    (a model built under ``with torch.device("cuda"), zero.Init(...)``); ``pin``: page-locked, sized
    exactly and counted under ``kind`` (``pinned.py``)."""
    if pin:
        return pinned.empty(numel, dtype, kind=kind, align=ALIGN)
    with torch.device("cpu"):
        return aligned_empty(numel, dtype)


def check_intact(file: SwapFile) -> None:
    """Raise when ``file`` is shorter than it was made (truncated under us, its drive replaced): reads of
    the lost range would come back as zeros, silently. One ``fstat``, called once per step."""
    size = os.fstat(file.fd).st_size
    if size < file.size:
        raise OSError(
            errno.EIO,
            f"the NVMe swap file {file.path} lost its contents (now {size} of {file.size} "
            f"bytes: truncated, or its drive replaced); the swapped states are gone, resume "
            f"from the last checkpoint",
        )


def block_elems(dtypes) -> int:
    """Elements per aligned block of the narrowest of ``dtypes``: a run of a multiple of it is whole
    ``ALIGN`` blocks in every one of them."""
    return ALIGN // min(d.itemsize for d in dtypes)


def chunk_elements(sub_group_size: int, align: int) -> int:
    """Elements per chunk: ``sub_group_size``, at most ``MAX_CHUNK``, rounded up to whole blocks of
    ``align`` elements."""
    return -(-max(1, min(int(sub_group_size), MAX_CHUNK)) // align) * align


@dataclass(frozen=True)
class Chunk:
    """Elements [lo, hi) of parameter ``index``; its record at byte ``offset`` of the swap file,
    ``padded`` elements per part."""

    index: int
    lo: int
    hi: int
    offset: int
    padded: int


class StateSwapper:
    """The swap file and host buffers for the per-element states of a list of flat parameters.

    Each chunk's record holds one padded run per entry of ``dtypes``, in that dtype: ``[exp_avg |
    exp_avg_sq]``, and with ZeRO-Infinity ``[exp_avg | exp_avg_sq | master | grad]`` (Kahan's
    compensation before the gradient with ``master_rounding: kahan``). The gradient, when there is
    one, is the last part (``GradSwap``).
    """

    def __init__(
        self,
        numels: list[int],
        directory: str,
        chunk: int,
        buffer_count: int,
        io: AsyncIO,
        pin: bool = False,
        dtypes: Sequence[torch.dtype] = FP32_PARTS,
        align: int = 1,
    ):
        if buffer_count < 2:
            raise ValueError(
                "offload_optimizer.buffer_count: NVMe swapping needs at least 2 buffers"
            )
        self.dtypes = tuple(dtypes)
        self.parts = len(self.dtypes)
        self.align = max(block_elems(self.dtypes), int(align))
        self.chunk = chunk_elements(chunk, self.align)
        self.io = io
        # bytes before part k per element of a record: part k of a chunk starts padded * _starts[k] in
        self._starts = [sum(d.itemsize for d in self.dtypes[:k]) for k in range(self.parts + 1)]
        self.chunks: list[list[Chunk]] = []
        offset = 0
        for index, n in enumerate(numels):
            mine = []
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                c = Chunk(index, lo, hi, offset, -(-(hi - lo) // self.align) * self.align)
                mine.append(c)
                offset += self.record_bytes(c)
            self.chunks.append(mine)
        self.file = SwapFile(directory, max(offset, ALIGN))
        biggest = max((c.padded for cs in self.chunks for c in cs), default=self.align)
        count = min(buffer_count, max(2, sum(len(cs) for cs in self.chunks)))
        # [record of the biggest chunk] bytes each: the record of the chunk in hand
        self.buffers = [
            host_buffer(biggest * self._starts[-1], torch.uint8, pin) for _ in range(count)
        ]
        self.wait_s = 0.0  # seconds spent waiting for this file's I/O (benchmarks read it)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of the file per element stepped, padding aside (8 for fp32 moments)."""
        return self._starts[-1]

    def record_bytes(self, c: Chunk, parts: Optional[int] = None) -> int:
        """Bytes of chunk ``c``'s first ``parts`` parts (all of them: its record)."""
        return c.padded * self._starts[self.parts if parts is None else parts]

    def wait(self, request: Optional[IORequest]) -> None:
        """Wait for ``request`` (None: nothing), counting the time in ``wait_s``."""
        if request is not None:
            began = time.perf_counter()
            request.wait()
            self.wait_s += time.perf_counter() - began

    def part(self, slot: int, c: Chunk, k: int) -> torch.Tensor:
        """Part ``k`` of chunk ``c``'s record in buffer ``slot``: a [hi - lo] view in its dtype."""
        start = self.record_bytes(c, k)
        size = (c.hi - c.lo) * self.dtypes[k].itemsize
        return self.buffers[slot][start : start + size].view(self.dtypes[k])

    def chunk_at(self, index: int, element: int) -> Chunk:
        """The chunk of parameter ``index`` that holds ``element``."""
        return self.chunks[index][element // self.chunk]

    def read(self, buf: torch.Tensor, offset: int) -> IORequest:
        """Fill ``buf`` from byte ``offset`` of the swap file, in the background."""
        return self.io.read(buf, self.file, offset)

    def write(self, buf: torch.Tensor, offset: int) -> IORequest:
        """Write ``buf`` at byte ``offset`` of the swap file, in the background."""
        return self.io.write(buf, self.file, offset)

    def moments(self, slot: int, c: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of chunk ``c`` in buffer ``slot``: [hi - lo] views."""
        return self.part(slot, c, 0), self.part(slot, c, 1)

    def stream(
        self,
        chunks: list[Chunk],
        fresh: Callable[[Chunk], bool],
        compute: Callable[[Chunk, torch.Tensor, torch.Tensor], None],
        write: bool = True,
        parts_in: int = 2,
        fresh_in: int = 0,
        fresh_fill=None,
        parts_out: int = 2,
        with_slot: bool = False,
    ) -> None:
        """Run ``compute(chunk, exp_avg, exp_avg_sq)`` over ``chunks`` with reads ahead and writes behind.

        Reads the record's first ``parts_in`` parts. A chunk for which ``fresh`` is true starts from
        zeros instead, except its parts from ``fresh_in`` on, which are read all the same (ZeRO-Infinity:
        the gradient), then ``fresh_fill(chunk, slot)`` runs (it fills the master). With ``write`` the
        first ``parts_out`` parts are written back after the compute. ``with_slot``: ``compute(chunk,
        slot)`` instead, to reach every part through ``part``.
        """
        count = len(self.buffers)
        ahead = max(
            1, count - 2
        )  # reads in flight beyond the chunk in hand; one write stays in flight too
        reads: dict[int, Optional[IORequest]] = {}
        writes: dict[int, IORequest] = {}  # slot -> the last write from it
        nxt = 0

        def launch(k: int) -> None:
            slot, c = k % count, chunks[k]
            self.wait(writes.pop(slot, None))
            buf = self.buffers[slot]
            start, end = self.record_bytes(c, fresh_in), self.record_bytes(c, parts_in)
            if fresh(c):
                buf[:start].zero_()
                if fresh_fill is not None:
                    fresh_fill(c, slot)
                reads[k] = (
                    self.read(buf[start:end], c.offset + start) if parts_in > fresh_in else None
                )
            else:
                reads[k] = self.read(buf[:end], c.offset)

        try:
            for k, c in enumerate(chunks):
                while nxt < len(chunks) and nxt <= k + ahead:
                    launch(nxt)
                    nxt += 1
                self.wait(reads.pop(k))
                slot = k % count
                if with_slot:
                    compute(c, slot)
                else:
                    compute(c, *self.moments(slot, c))
                if write:
                    end = self.record_bytes(c, parts_out)
                    writes[slot] = self.write(self.buffers[slot][:end], c.offset)
        finally:  # also after an error: no request may outlive the buffers it uses
            for request in list(reads.values()) + list(writes.values()):
                self.wait(request)

    def close(self) -> None:
        """Stop the I/O threads and close the swap file (the moments are gone after this)."""
        self.io.close()
        self.file.close()


class GradSwap:
    """ZeRO-Infinity's gradients: each reduced bucket's shard is written (added, after the first
    micro-step of an accumulation) into the gradient part of the records it covers, behind.

    A piece on the device comes down through ``copies.download`` (on a GPU: a side-stream copy into a
    pinned buffer, ordered by an event); the host finishes it (adds what the file holds, sums its
    squares, writes it) once it has landed: polled as later buckets arrive, all of them by ``flush``.
    So backward does not wait for a bucket's copy, only when ``IN_FLIGHT`` buffers are all taken."""

    IN_FLIGHT = 4  # pieces copying down or being written behind; each holds its host buffer

    def __init__(self, swapper: StateSwapper, copies: Optional[HostCopies] = None):
        self.swapper = swapper
        self.copies = copies if copies is not None else HostCopies()
        self.written: dict[
            tuple[int, int], list[tuple[int, int]]
        ] = {}  # (index, chunk lo) -> ranges this window
        self._landing: deque = (
            deque()
        )  # (landing, chunk, a, b, buffer, add the file's sum, total) in order
        self._writes: list[tuple[IORequest, torch.Tensor]] = []
        self._spare: list[torch.Tensor] = []
        self._largest = 0  # elements of the largest piece yet (the size new buffers get)
        self._bases: dict[int, torch.Tensor] = {}  # data_ptr -> a buffer in use or spare, whole
        self._unchecked = (
            True  # the file's size is checked before a window's first write (they would extend it)
        )

    @property
    def dtype(self) -> torch.dtype:
        """The gradients' dtype in the file: the masters' (fp32, or bf16 with bf16 masters)."""
        return self.swapper.dtypes[-1]

    def _grad_offset(self, c: Chunk, element: int) -> int:
        last = self.swapper.parts - 1  # the gradient is the record's last part
        return (
            c.offset + self.swapper.record_bytes(c, last) + (element - c.lo) * self.dtype.itemsize
        )

    def accumulate(self, index: int, lo: int, hi: int, piece: torch.Tensor) -> torch.Tensor:
        """Add ``piece`` (elements [lo, hi) of parameter ``index``'s gradient, any device) into the file;
        returns the sum of squares of the accumulated values written (0-dim float64, final after ``flush``)."""
        if self._unchecked:
            check_intact(self.swapper.file)
            self._unchecked = False
        total = torch.zeros((), dtype=torch.float64, device="cpu")
        k = lo
        while k < hi:
            c = self.swapper.chunk_at(index, k)
            a, b = k, min(hi, c.hi)
            block = ALIGN // self.dtype.itemsize  # O_DIRECT: whole blocks of the file
            assert (a - c.lo) % block == 0 and ((b - a) % block == 0 or b == c.hi), (
                "unaligned bucket"
            )
            n = (
                c.padded - (a - c.lo) if b == c.hi else b - a
            )  # the record's tail padding goes along
            buf = self._buffer(n)
            buf[b - a :].zero_()
            landing = self.copies.download(buf[: b - a], piece[a - lo : b - lo])
            ranges = self.written.setdefault((index, c.lo), [])
            again = any(x < b and a < y for x, y in ranges)  # accumulated before in this window
            ranges.append((a, b))
            self._landing.append((landing, c, a, b, buf, again, total))
            k = b
        self._finish(block=False)
        return total

    def _finish(self, block: bool) -> None:
        """Finish the pieces that have landed (``block``: all of them), in order: add the sum so far where
        the range was written before in this window, sum the squares, write behind."""
        from ..ops.grad import sum_of_squares

        while self._landing and (block or self._landing[0][0].query()):
            landing, c, a, b, buf, again, total = self._landing.popleft()
            landing.synchronize()
            if again:
                self._wait_writes()
                before = host_buffer(buf.numel(), self.dtype)
                self.swapper.read(before, self._grad_offset(c, a)).wait()
                buf[: b - a].add_(before[: b - a])
            total += sum_of_squares(buf[: b - a]).to(torch.float64).cpu()
            self._writes.append((self.swapper.write(buf, self._grad_offset(c, a)), buf))

    def _wait_writes(self) -> None:
        for request, buf in self._writes:
            self.swapper.wait(request)
            self._spare.append(self._whole(buf))
        self._writes = []

    def _whole(self, buf: torch.Tensor) -> torch.Tensor:
        """The whole buffer a piece's ``buf`` (its first elements) was cut from."""
        return self._bases.get(buf.data_ptr(), buf)

    def _buffer(self, n: int) -> torch.Tensor:
        self._finish(block=False)
        while len(self._writes) + len(self._landing) >= self.IN_FLIGHT:
            if self._writes:
                request, buf = self._writes.pop(0)
                self.swapper.wait(request)
                self._spare.append(self._whole(buf))
            else:  # every buffer is still copying down: wait for the oldest
                self._finish_one()
        for i, buf in enumerate(self._spare):
            if buf.numel() >= n:
                return self._spare.pop(i)[:n]
        # pinned where the device copies into host memory asynchronously (staging, whatever pin_memory says).
        # None of the spares fits: they go, and the new one is as large as the largest piece so far, so that
        # pinned buffers settle at IN_FLIGHT of one size, registered once (pinned.py), not every step.
        for buf in self._spare:
            self._bases.pop(buf.data_ptr(), None)
        self._spare = []
        self._largest = max(self._largest, n)
        buf = host_buffer(self._largest, self.dtype, self.copies.pins, pinned.STAGING)
        self._bases[buf.data_ptr()] = buf
        return buf[:n]

    def _finish_one(self) -> None:
        self._landing[0][0].synchronize()
        self._finish(block=False)

    def flush(self) -> None:
        """Finish every piece and wait for every write behind (before anything reads the records or the
        sums of squares); drop the buffers, unless pinned (registered once, kept for the next step)."""
        self._finish(block=True)
        self._wait_writes()
        if not self.copies.pins:
            self._spare, self._bases = [], {}

    def reset(self) -> None:
        """A new accumulation window: the next write of each range replaces what the file holds."""
        self.flush()
        self.written.clear()
        self._unchecked = True

    def gaps(self, c: Chunk) -> list[tuple[int, int]]:
        """Ranges of chunk ``c`` no gradient was written to in this window."""
        out, at = [], c.lo
        for a, b in sorted(self.written.get((c.index, c.lo), [])):
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < c.hi:
            out.append((at, c.hi))
        return out

    def read(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s accumulated gradient, read whole ([numel] in ``dtype``; zeros where none
        was written)."""
        self.flush()
        chunks = self.swapper.chunks[index]
        out = torch.zeros(chunks[-1].hi if chunks else 0, dtype=self.dtype, device="cpu")
        for c in chunks:
            buf = host_buffer(c.padded, self.dtype)
            self.swapper.read(buf, self._grad_offset(c, c.lo)).wait()
            out[c.lo : c.hi].copy_(buf[: c.hi - c.lo])
            for a, b in self.gaps(c):
                out[a:b].zero_()
        return out
