"""ZeRO-Infinity's parameter half: this rank's stage-3 parameter shards in a swap file.

``offload_param: {device: nvme, nvme_path: DIR}`` keeps each rank's compute-dtype shards
in one file under ``DIR`` (``ops/aio.SwapFile``: unlinked at open, reserved up front).
A gather reads a parameter's shard into a buffer of a bounded pool (``buffer_count``
buffers of ``buffer_size`` elements, pinned with ``pin_memory`` on a GPU machine), copies it
into the gather's staging and gives the buffer back. The fetcher reads ahead along the same
trace that drives its prefetched all-gathers (``prefetch``), so the drive works while the
model computes. The first ``max_in_cpu`` elements (in registration order) stay resident in
host memory as well and are never read from the file.

The optimizer writes the updated shards back through ``write_range`` (whole chunks of a
group's flat shard, written behind while the next chunk is computed); the file is always
the authority, the resident copies a cache kept in step with it.

Layout: each group's shard is one contiguous region of the file (``add_group``), laid out
as the group's flat shard, whose offsets are aligned (``align_elems``) so that every
parameter's shard and every optimizer chunk starts on an O_DIRECT boundary.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Optional

import torch

from ..ops.aio import ALIGN, AsyncIO, IORequest, SwapFile
from . import pinned
from .copies import device_streams, host_pinning
from .state_swap import check_intact, host_buffer

if TYPE_CHECKING:  # annotations only
    from ..config.zero import OffloadParamConfig

logger = logging.getLogger("zengine")


def align_elems(dtype: torch.dtype) -> int:
    """Elements per alignment unit so that ``dtype`` and fp32 offsets both fall on ALIGN bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    return ALIGN // min(item, 4)


def on_disk(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What stands in memory for a flat shard that lives in a swap file: an empty host tensor of its
    dtype (its size is kept by its owner; code that reads it by mistake finds no elements, never
    stale memory)."""
    return torch.empty(0, dtype=dtype, device="cpu")


def round_up(n: int, unit: int) -> int:
    return -(-int(n) // unit) * unit


class _Slot:
    """A pool buffer and what it holds: the parameter read into it and the read in flight."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf  # [buffer_size] compute dtype, ALIGN-aligned
        self.owner = None  # the ShardedParam whose shard it holds (or is reading)
        self.read: Optional[IORequest] = None
        self.used = None  # a CUDA event after the last copy out of it (reuse waits for it)


class ParamSwap:
    """The swap file and the read pool for one rank's NVMe-offloaded parameter shards."""

    def __init__(
        self,
        offload_cfg: OffloadParamConfig,
        dtype: torch.dtype,
        io: AsyncIO,
        device: torch.device,
        sizes: list[int],
    ):
        self.directory = str(offload_cfg.nvme_path)
        self.dtype = dtype
        self.item = torch.empty((), dtype=dtype).element_size()
        self.align = align_elems(dtype)
        self.io = io
        self.device = device
        self.pin = bool(offload_cfg.pin_memory) and host_pinning(device)
        self.max_in_cpu = int(offload_cfg.max_in_cpu)
        self.resident_numel = 0
        total = sum(sizes)
        self.file = SwapFile(
            self.directory, max(total * self.item, ALIGN), prefix="zengine-params-"
        )
        self._next = 0  # elements of the file handed out
        self.buffer_numel = round_up(max(int(offload_cfg.buffer_size), 1), self.align)
        self.buffer_count = max(2, int(offload_cfg.buffer_count))
        self.largest = 0  # the largest padded shard registered: the pool's buffers need no more
        self.slots: list[_Slot] = []  # made at the first read, buffer_count of them
        self._holding: dict[
            int, _Slot
        ] = {}  # id(ShardedParam) -> its slot (reading, read, or in use)
        self._prefetched: OrderedDict[int, _Slot] = OrderedDict()  # read ahead, not yet taken
        self._writes: deque = deque()  # (request, buffer) written behind
        self._write_bufs: list[torch.Tensor] = []
        self.wait_s = (
            0.0  # seconds a gather or the step waited for this swap's I/O (benchmarks read it)
        )
        self.prefetch_hits = self.demand_reads = (
            0  # shards taken after a read ahead / read when asked for
        )
        self.extra_buffers = 0  # temporary buffers made because every pool buffer was in use

    # -- layout ---------------------------------------------------------------------------------
    def add_group(self, numel: int) -> int:
        """Reserve ``numel`` elements (a group's aligned flat shard); returns their first element."""
        base = self._next
        self._next += numel
        assert self._next * self.item <= self.file.size, (
            "ParamSwap: more parameters than the file was sized for"
        )
        return base

    def check_fits(self, name: str, padded_chunk: int) -> None:
        """A parameter's shard must fit one pool buffer (say which and how big before any work)."""
        self.largest = max(self.largest, padded_chunk)
        if padded_chunk > self.buffer_numel:
            raise ValueError(
                f"offload_param.buffer_size ({self.buffer_numel} elements) is smaller than parameter "
                f"{name!r}'s shard ({padded_chunk} elements); raise buffer_size to at least "
                f"{padded_chunk}"
            )

    def keep_resident(self, numel: int) -> bool:
        """Whether a parameter shard of ``numel`` elements stays in host memory too (``max_in_cpu``)."""
        if self.resident_numel + numel > self.max_in_cpu:
            return False
        self.resident_numel += numel
        return True

    def check(self) -> None:
        """Raise, naming the file, when it lost its contents (checked once per forward)."""
        check_intact(self.file)

    # -- one parameter's shard ------------------------------------------------------------------
    def write_shard(self, sp, src: torch.Tensor) -> None:
        """Write ``src`` (sp's [chunk] shard, any dtype and device) to sp's place in the file, now."""
        n = round_up(sp.chunk, self.align)
        buf = host_buffer(n, self.dtype)
        buf[sp.chunk :].zero_()
        buf[: sp.chunk].copy_(src)
        self._io(True, buf, sp.file_elem).wait()
        if sp.shard is not None:  # resident: keep the cache in step
            sp.shard.copy_(buf[: sp.chunk])

    def take_copy(self, sp) -> torch.Tensor:
        """sp's shard read into a tensor of its own ([chunk] compute dtype)."""
        value = self.take(sp).clone()
        self.give_back(sp)
        return value

    def forget(self, sp) -> None:
        """sp's shard has moved elsewhere (the engine's swap took over one built under zero.Init)."""

    def start_read(self, sp, prefetch: bool = False) -> bool:
        """Begin reading sp's shard into a free buffer; False when none is free (prefetch does not evict)."""
        if id(sp) in self._holding:
            return True
        need = round_up(sp.chunk, self.align)
        if not self.slots:  # [min(buffer_size, largest shard)] compute dtype each
            self.buffer_numel = min(self.buffer_numel, max(self.largest, need))
            self.slots = [
                _Slot(host_buffer(self.buffer_numel, self.dtype, self.pin, pinned.SWAP))
                for _ in range(self.buffer_count)
            ]
        slot = self._free_slot(evict=not prefetch) if need <= self.buffer_numel else None
        if slot is None:
            if prefetch:
                return False
            # every buffer is in use (or, under zero.Init, this shard is larger than the first ones): one more
            slot = _Slot(
                host_buffer(max(need, self.buffer_numel), self.dtype, self.pin, pinned.SWAP)
            )
            self.extra_buffers += 1
            logger.debug("offload_param: swap pool exhausted; a temporary buffer for %s", sp.name)
        if slot.used is not None:
            slot.used.synchronize()
            slot.used = None
        slot.owner = sp
        slot.read = self._io(False, slot.buf[:need], sp.file_elem)
        self._holding[id(sp)] = slot
        if prefetch:
            self._prefetched[id(sp)] = slot
        else:
            self.demand_reads += 1
        return True

    def take(self, sp) -> torch.Tensor:
        """sp's shard ([chunk] compute dtype, in a pool buffer): read now unless read ahead. Give it back."""
        if id(sp) in self._prefetched:
            self.prefetch_hits += 1
        self.start_read(sp)
        slot = self._holding[id(sp)]
        self._prefetched.pop(id(sp), None)
        if slot.read is not None:
            began = time.perf_counter()
            slot.read.wait()
            self.wait_s += time.perf_counter() - began
            slot.read = None
        return slot.buf[: sp.chunk]

    def give_back(self, sp) -> None:
        """sp's buffer may be reused (after a device copy out of it completes)."""
        slot = self._holding.pop(id(sp), None)
        if slot is None:
            return
        streams = device_streams(self.device)
        if streams is not None:
            slot.used = streams.Event()
            # on the compute device's stream, which need not be the current device (zero.Init never sets it)
            slot.used.record(streams.current_stream(self.device))
        slot.owner = None  # (a temporary buffer is simply dropped: no slot refers to it)

    def prefetch(self, sps) -> bool:
        """Read ahead the shards of ``sps`` (in order) while buffers are free; False when they ran out."""
        for sp in sps:
            if id(sp) not in self._holding and not self.start_read(sp, prefetch=True):
                return False
        return True

    def forget_prefetched(self) -> None:
        """Drop every read-ahead shard (the step is about to change them; stray reads finish first)."""
        for key, slot in list(self._prefetched.items()):
            if slot.read is not None:
                slot.read.wait()
                slot.read = None
            self._holding.pop(key, None)
            slot.owner = None
        self._prefetched.clear()

    def _free_slot(self, evict: bool) -> Optional[_Slot]:
        for slot in self.slots:
            if slot.owner is None:
                return slot
        if evict and self._prefetched:  # an on-demand read takes the buffer of the last read ahead
            key, slot = self._prefetched.popitem()
            if slot.read is not None:
                slot.read.wait()
                slot.read = None
            self._holding.pop(key, None)
            slot.owner = None
            return slot
        return None

    # -- updated shards from the optimizer ------------------------------------------------------
    def write_range(self, base: int, lo: int, hi: int, values: torch.Tensor, resident=()) -> None:
        """Write elements [lo, hi) of the group at ``base`` (fp32 ``values``, cast here), behind: at most two
        writes stay in flight. ``resident``: (sp, offset) of the group's resident shards, updated in memory."""
        n = hi - lo
        buf = self._write_buffer(n)
        buf[:n].copy_(values)
        for sp, off in resident:
            a, b = max(lo, off), min(hi, off + sp.chunk)
            if b > a:
                sp.shard[a - off : b - off].copy_(buf[a - lo : b - lo])
        self._writes.append((self._io(True, buf[: round_up(n, self.align)], base + lo), buf))

    def _write_buffer(self, n: int) -> torch.Tensor:
        while len(self._writes) >= 2:
            request, buf = self._writes.popleft()
            began = time.perf_counter()
            request.wait()
            self.wait_s += time.perf_counter() - began
            self._write_bufs.append(buf)
        for i, buf in enumerate(self._write_bufs):
            if buf.numel() >= round_up(n, self.align):
                return self._write_bufs.pop(i)
        return host_buffer(round_up(n, self.align), self.dtype)

    def flush(self) -> None:
        """Wait for every write behind; drop the write buffers (host memory between steps is the pool)."""
        began = time.perf_counter()
        while self._writes:
            request, _ = self._writes.popleft()
            request.wait()
        self.wait_s += time.perf_counter() - began
        self._write_bufs = []

    def read_range(self, base: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the group at ``base``, read now into a fresh buffer ([hi - lo] compute dtype)."""
        buf = host_buffer(round_up(hi - lo, self.align), self.dtype)
        self._io(False, buf, base + lo).wait()
        return buf[: hi - lo]

    def _io(self, write: bool, buf: torch.Tensor, elem: int) -> IORequest:
        if write:
            return self.io.write(buf, self.file, elem * self.item)
        return self.io.read(buf, self.file, elem * self.item)

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory the swap holds: the pool."""
        return [s.buf for s in self.slots]

    def close(self) -> None:
        """Finish the I/O and close the file (the shards are gone after this)."""
        try:
            self.flush()
            self.forget_prefetched()
        finally:
            self.io.close()
            self.file.close()


class GrowingSwap(ParamSwap):
    """``zero.Init``'s swap: each shard is appended as its module is built, so the model is never whole
    in memory; the engine's ``ParamSwap`` takes the shards over (``forget``), and the file is closed
    once none is left."""

    def __init__(
        self, offload_cfg: OffloadParamConfig, dtype: torch.dtype, io: AsyncIO, device: torch.device
    ):
        super().__init__(offload_cfg, dtype, io, device, [0])
        self.live = 0

    def add(self, sp) -> None:
        """Move sp's (gathered) chunk into the file; the caller frees the full data."""
        n = round_up(sp.chunk, self.align)
        self.check_fits(sp.name, n)
        elem, self._next = self._next, self._next + n
        need = self._next * self.item
        if need > self.file.size:
            size = max(need, 2 * self.file.size)
            try:
                os.posix_fallocate(self.file.fd, 0, size)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"zero.Init: cannot grow the parameter swap file in {self.directory} to "
                    f"{size / 2**30:.2f} GiB: {os.strerror(e.errno)}; free space there or point "
                    f"offload_param.nvme_path elsewhere",
                ) from e
            self.file.size = size
        sp.move_to_swap(self, elem, False)
        self.live += 1

    def take_copy(self, sp) -> torch.Tensor:
        buf = host_buffer(round_up(sp.chunk, self.align), self.dtype)
        self._io(False, buf, sp.file_elem).wait()
        return buf[: sp.chunk]

    def forget(self, sp) -> None:
        self.live -= 1
        if self.live == 0:
            self.close()
