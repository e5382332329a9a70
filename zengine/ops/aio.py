"""Asynchronous file I/O for NVMe swapping: ``AsyncIO`` (reads and writes in the background)
and ``SwapFile`` (an open, already-unlinked file that requests address by byte offset).

The compiled ``async_io`` op (csrc/aio/) runs a pool of threads that cut each request into
``block_size`` pieces and ``pread``/``pwrite`` them, so a step can compute on one buffer while
others are read and written. Where the op cannot be built, a pool of Python threads does the
same with ``os.preadv``/``os.pwritev`` (they release the GIL too), after one warning.

Both pools choose the next block the same way (``priority=True``, the default): first the blocks
of a request somebody is waiting on, then reads (the compute waits on them), then writes, each
class in submission order; so a large write queued ahead does not hold up the read the step is
blocked on. ``priority=False`` gives one FIFO of blocks. ``stats()`` counts bytes moved and the
seconds the pool had I/O in flight, for throughput figures.

Requests move a contiguous CPU tensor's bytes; the tensor is kept alive by its request until
``wait``. ``SwapFile`` opens with ``O_DIRECT`` when asked and the filesystem allows it (no page
cache: the bytes really go to the drive); then buffer addresses, sizes and offsets must be
multiples of ``ALIGN`` bytes, which the swappers arrange.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Optional

import torch

from .builder import load_op

__all__ = ["ALIGN", "AsyncIO", "IORequest", "IOStats", "SwapFile", "aligned_empty"]

ALIGN = 4096  # bytes: O_DIRECT's alignment for address, size and offset on common drives
# Defaults from benchmarks/bench_swap.py --sweep (results/swap_2026-11-23.md): blocks of 256 KiB to
# 1 MiB with 8 to 32 in flight kept pace with the drive, 2 MiB and larger blocks were ~10 % slower;
# 512 KiB x 16 sits in the middle of that range.
DEFAULT_BLOCK = 512 << 10
DEFAULT_DEPTH = 16


def aligned_empty(
    numel: int, dtype: torch.dtype = torch.float32, pin: bool = False
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on an ``ALIGN`` boundary."""
    item = torch.empty((), dtype=dtype).element_size()
    slack = ALIGN // item
    raw = torch.empty(numel + slack, dtype=dtype, pin_memory=pin)  # [numel + slack]
    skip = (-raw.data_ptr() % ALIGN) // item
    return raw[skip : skip + numel]


class SwapFile:
    """A file for swapped tensors. It is unlinked as soon as it is open, so it vanishes with the
    process however that ends; ``size`` bytes are reserved up front so a full disk fails here,
    before training, rather than midway."""

    def __init__(
        self,
        directory: str | os.PathLike,
        size: int,
        direct: bool = True,
        prefix: str = "zengine-swap-",
    ):
        try:
            os.makedirs(directory, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot create an NVMe swap file in {directory}: {e.strerror}; nvme_path must "
                f"name a writable directory",
            ) from e
        os.close(fd)
        self.path = path
        self.direct = False
        flags = os.O_RDWR
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.fd = os.open(path, flags | os.O_DIRECT)
                    self.direct = True
                except OSError as e:  # tmpfs and some others refuse O_DIRECT
                    if e.errno != errno_mod.EINVAL:
                        raise
                    self.fd = os.open(path, flags)
            else:
                self.fd = os.open(path, flags)
        finally:
            os.unlink(path)
        self.size = int(size)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, 0, self.size)
            else:
                os.ftruncate(self.fd, self.size)
        except OSError as e:
            os.close(self.fd)
            raise OSError(
                e.errno,
                f"cannot reserve {self.size / 2**20:.1f} MiB for NVMe swap in {directory}: "
                f"{os.strerror(e.errno)}; free space there or point nvme_path elsewhere",
            ) from e

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class IORequest:
    """One read or write in flight; ``wait()`` returns once its bytes have moved, or raises OSError."""

    def __init__(self, io: "AsyncIO", ident, tensor: torch.Tensor, what: str):
        self._io, self._ident, self._tensor, self._what = io, ident, tensor, what

    def done(self) -> bool:
        """True when ``wait()`` would return (or raise) at once."""
        return self._io is None or self._io._done(self._ident)

    def wait(self) -> None:
        if self._io is None:
            return
        io, ident, self._io = self._io, self._ident, None
        err = io._wait(ident)
        self._tensor = None
        if err == -1:
            raise OSError(errno_mod.EIO, f"{self._what}: the file ended before the request did")
        if err:
            raise OSError(err, f"{self._what}: {os.strerror(err)}")


@dataclass(frozen=True)
class IOStats:
    """What a pool moved: bytes and requests completed, and wall seconds with at least one block
    of reads (``read_seconds``), of writes (``write_seconds``) or of either (``busy_seconds``) inside
    ``pread``/``pwrite``. Subtract two snapshots for one step: ``after - before``."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    busy_seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def gbps(self, seconds: Optional[float] = None) -> float:
        """Bytes moved per second (1e9 bytes), over ``seconds`` (default: the busy seconds)."""
        seconds = self.busy_seconds if seconds is None else seconds
        return self.bytes / seconds / 1e9 if seconds > 0 else 0.0

    def __sub__(self, other: "IOStats") -> "IOStats":
        return IOStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


class AsyncIO:
    """Moves ``block_size`` bytes per block with ``thread_count * queue_depth`` blocks in flight.

    DeepSpeed's ``aio`` keys mean: ``thread_count`` submitting threads, each keeping
    ``queue_depth`` requests outstanding. Here every outstanding block is a pool thread asleep
    in ``pread``/``pwrite``, so the pool has ``thread_count * queue_depth`` workers: the same
    number of requests reach the drive. A request is cut into blocks that several workers move
    at once. ``priority`` (keyword only): serve waited-on requests, then reads, then writes;
    False serves blocks in submission order.
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK,
        thread_count: int = 1,
        queue_depth: int = DEFAULT_DEPTH,
        use_kernel: bool = True,
        *,
        priority: bool = True,
    ):
        self.block_size = int(block_size)
        if self.block_size <= 0:
            raise ValueError(f"AsyncIO: block_size must be positive, got {block_size}")
        self.thread_count = max(1, int(thread_count)) * max(1, int(queue_depth))
        self.priority = bool(priority)
        self._kernel = load_op("async_io") if use_kernel else None
        self._handle: Optional[int] = None
        self._pool: Optional[_ThreadPool] = None
        if self._kernel is not None:
            self._handle = self._kernel.pool_new(self.thread_count, self.block_size, self.priority)
        else:
            self._pool = _ThreadPool(self.thread_count, self.block_size, self.priority)

    @property
    def compiled(self) -> bool:
        """True when the compiled op does the I/O (else Python threads)."""
        return self._handle is not None

    def read(self, tensor: torch.Tensor, file: SwapFile, offset: int) -> IORequest:
        """Fill ``tensor`` with its byte size of ``file`` from byte ``offset``."""
        return self._submit(False, tensor, file, offset)

    def write(self, tensor: torch.Tensor, file: SwapFile, offset: int) -> IORequest:
        """Write ``tensor``'s bytes into ``file`` at byte ``offset``."""
        return self._submit(True, tensor, file, offset)

    def stats(self) -> IOStats:
        """Totals since this pool started (see ``IOStats``); zeros once closed."""
        if self._handle is not None:
            br, bw, nr, nw, rns, wns, bns = self._kernel.stats(self._handle)
            return IOStats(br, bw, nr, nw, rns * 1e-9, wns * 1e-9, bns * 1e-9)
        if self._pool is not None:
            return self._pool.stats()
        return IOStats()

    def _submit(self, write: bool, tensor: torch.Tensor, file: SwapFile, offset: int) -> IORequest:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("AsyncIO moves contiguous CPU tensors only")
        nbytes = tensor.numel() * tensor.element_size()
        if offset < 0 or offset + nbytes > file.size:
            raise ValueError(
                f"AsyncIO: bytes [{offset}, {offset + nbytes}) lie outside the {file.size}-byte swap file"
            )
        if file.direct and (tensor.data_ptr() % ALIGN or nbytes % ALIGN or offset % ALIGN):
            raise ValueError(
                f"AsyncIO: O_DIRECT needs address, size and offset in multiples of {ALIGN} bytes"
            )
        what = f"{'writing' if write else 'reading'} {nbytes} bytes at {offset} of the NVMe swap file {file.path}"
        if self._handle is not None:
            ident = self._kernel.submit(
                self._handle, write, file.fd, tensor.data_ptr(), nbytes, offset
            )
        elif self._pool is not None:
            ident = self._pool.submit(write, file.fd, tensor.data_ptr(), nbytes, offset)
        else:
            raise ValueError("AsyncIO: the pool is closed")
        return IORequest(self, ident, tensor, what)

    def _wait(self, ident) -> int:
        if self._handle is not None:
            return self._kernel.wait(self._handle, ident)
        if self._pool is not None:
            return self._pool.wait(ident)
        return 0  # closed: close() finished every request; its outcome is gone

    def _done(self, ident) -> bool:
        if self._handle is not None:
            return self._kernel.done(self._handle, ident) != 0
        return self._pool is None or self._pool.done(ident)

    def close(self) -> None:
        """Finish queued requests and stop the threads."""
        if self._handle is not None:
            self._kernel.pool_free(self._handle)
            self._handle = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Request:
    __slots__ = (
        "write",
        "fd",
        "ptr",
        "nbytes",
        "offset",
        "issued",
        "blocks_left",
        "error",
        "urgent",
    )

    def __init__(self, write: bool, fd: int, ptr: int, nbytes: int, offset: int, block: int):
        self.write, self.fd, self.ptr, self.nbytes, self.offset = write, fd, ptr, nbytes, offset
        self.issued = 0
        self.blocks_left = -(-nbytes // block)
        self.error = 0
        self.urgent = False


class _Busy:
    """Wall time with at least one block of a kind in flight."""

    __slots__ = ("active", "since", "seconds")

    def __init__(self):
        self.active, self.since, self.seconds = 0, 0.0, 0.0

    def start(self, now: float) -> None:
        if self.active == 0:
            self.since = now
        self.active += 1

    def stop(self, now: float) -> None:
        self.active -= 1
        if self.active == 0:
            self.seconds += now - self.since

    def total(self, now: float) -> float:
        return self.seconds + (now - self.since if self.active else 0.0)


class _ThreadPool:
    """The fallback: the compiled pool (csrc/aio/async_io.cpp) in Python, same order of blocks."""

    def __init__(self, threads: int, block: int, priority: bool):
        self.block, self.priority = block, priority
        self.cond = threading.Condition()
        self.urgent: deque = deque()
        self.reads: deque = deque()
        self.writes: deque = deque()
        self.requests: dict[int, _Request] = {}
        self.next_id = 1
        self.stopping = False
        self.counts = [0, 0, 0, 0]  # bytes read, bytes written, reads, writes
        self.busy = (_Busy(), _Busy(), _Busy())  # reads, writes, any
        self.workers = [
            threading.Thread(target=self._work, name=f"zengine-aio-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self.workers:
            t.start()

    def submit(self, write: bool, fd: int, ptr: int, nbytes: int, offset: int) -> int:
        with self.cond:
            ident = self.next_id
            self.next_id += 1
            r = _Request(write, fd, ptr, nbytes, offset, self.block)
            self.requests[ident] = r
            if r.blocks_left:
                (self.writes if self.priority and write else self.reads).append(ident)
                self.cond.notify_all()
            return ident

    def wait(self, ident: int) -> int:
        with self.cond:
            r = self.requests.get(ident)
            if r is None:
                return errno_mod.EINVAL
            if self.priority and not r.urgent and r.issued < r.nbytes:
                queue = self.writes if r.write else self.reads
                try:
                    queue.remove(ident)
                except ValueError:
                    pass
                else:
                    self.urgent.append(ident)
                    r.urgent = True
            while r.blocks_left:
                self.cond.wait()
            del self.requests[ident]
            return r.error

    def done(self, ident: int) -> bool:
        with self.cond:
            r = self.requests.get(ident)
            return r is None or r.blocks_left == 0

    def stats(self) -> IOStats:
        with self.cond:
            now = time.perf_counter()
            return IOStats(*self.counts, *(b.total(now) for b in self.busy))

    def _next(self):
        queue = self.urgent or self.reads or self.writes
        if not queue:
            return None
        r = self.requests[queue[0]]
        n = min(self.block, r.nbytes - r.issued)
        job = (r, r.ptr + r.issued, n, r.offset + r.issued)
        r.issued += n
        if r.issued == r.nbytes:
            queue.popleft()
        return job

    def _work(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.urgent or self.reads or self.writes):
                    self.cond.wait()
                job = self._next()
                if job is None:
                    return
                r = job[0]
                now = time.perf_counter()
                self.busy[r.write].start(now)
                self.busy[2].start(now)
            err = _move(r.write, r.fd, *job[1:])
            with self.cond:
                now = time.perf_counter()
                self.busy[r.write].stop(now)
                self.busy[2].stop(now)
                if err and not r.error:
                    r.error = err
                if not err:
                    self.counts[r.write] += job[2]
                r.blocks_left -= 1
                if r.blocks_left == 0:
                    self.counts[2 + r.write] += 1
                    self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for t in self.workers:
            t.join()


def _move(write: bool, fd: int, ptr: int, nbytes: int, offset: int) -> int:
    """One block of the fallback: 0, an errno, or -1 at end of file."""
    done = 0
    while done < nbytes:
        n = nbytes - done
        view = memoryview((ctypes.c_char * n).from_address(ptr + done)).cast("B")
        try:
            moved = (
                os.pwritev(fd, [view], offset + done)
                if write
                else os.preadv(fd, [view], offset + done)
            )
        except InterruptedError:
            continue
        except OSError as e:
            return e.errno or errno_mod.EIO
        if moved == 0:
            return -1
        done += moved
    return 0
