"""Asynchronous file I/O for NVMe swapping: ``AsyncIO`` (reads and writes in the background)
and ``SwapFile`` (an open, already-unlinked file that requests address by byte offset).

The compiled ``async_io`` op (csrc/aio/) runs a pool of threads that cut each request into
``block_size`` pieces and ``pread``/``pwrite`` them, so a step can compute on one buffer while
others are read and written. Where the op cannot be built, a pool of Python threads does the
same with ``os.preadv``/``os.pwritev`` (they release the GIL too), after one warning.

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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from .builder import load_op

__all__ = ["ALIGN", "AsyncIO", "IORequest", "SwapFile", "aligned_empty"]

ALIGN = 4096  # bytes: O_DIRECT's alignment for address, size and offset on common drives


def aligned_empty(numel: int, dtype: torch.dtype = torch.float32, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on an ``ALIGN`` boundary."""
    item = torch.empty((), dtype=dtype).element_size()
    slack = ALIGN // item
    raw = torch.empty(numel + slack, dtype=dtype, pin_memory=pin)  # [numel + slack]
    skip = (-raw.data_ptr() % ALIGN) // item
    return raw[skip:skip + numel]


class SwapFile:
    """A file for swapped tensors. It is unlinked as soon as it is open, so it vanishes with the
    process however that ends; ``size`` bytes are reserved up front so a full disk fails here,
    before training, rather than midway."""

    def __init__(self, directory: str | os.PathLike, size: int, direct: bool = True, prefix: str = "zengine-swap-"):
        try:
            os.makedirs(directory, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
        except OSError as e:
            raise OSError(e.errno, f"cannot create an NVMe swap file in {directory}: {e.strerror}; nvme_path must "
                                   f"name a writable directory") from e
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
            raise OSError(e.errno, f"cannot reserve {self.size / 2**20:.1f} MiB for NVMe swap in {directory}: "
                                   f"{os.strerror(e.errno)}; free space there or point nvme_path elsewhere") from e

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


class AsyncIO:
    """Moves ``block_size`` bytes per block with ``thread_count * queue_depth`` blocks in flight.

    DeepSpeed's ``aio`` keys mean: ``thread_count`` submitting threads, each keeping
    ``queue_depth`` requests outstanding. Here every outstanding block is a pool thread asleep
    in ``pread``/``pwrite``, so the pool has ``thread_count * queue_depth`` workers: the same
    number of requests reach the drive.
    """

    def __init__(self, block_size: int = 1 << 20, thread_count: int = 1, queue_depth: int = 1,
                 use_kernel: bool = True):
        self.block_size = int(block_size)
        self.thread_count = max(1, int(thread_count)) * max(1, int(queue_depth))
        self._kernel = load_op("async_io") if use_kernel else None
        self._handle: Optional[int] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        if self._kernel is not None:
            self._handle = self._kernel.pool_new(self.thread_count, self.block_size)
        else:
            self._executor = ThreadPoolExecutor(self.thread_count, thread_name_prefix="zengine-aio")

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

    def _submit(self, write: bool, tensor: torch.Tensor, file: SwapFile, offset: int) -> IORequest:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("AsyncIO moves contiguous CPU tensors only")
        nbytes = tensor.numel() * tensor.element_size()
        if offset < 0 or offset + nbytes > file.size:
            raise ValueError(f"AsyncIO: bytes [{offset}, {offset + nbytes}) lie outside the {file.size}-byte swap file")
        if file.direct and (tensor.data_ptr() % ALIGN or nbytes % ALIGN or offset % ALIGN):
            raise ValueError(f"AsyncIO: O_DIRECT needs address, size and offset in multiples of {ALIGN} bytes")
        what = f"{'writing' if write else 'reading'} {nbytes} bytes at {offset} of the NVMe swap file {file.path}"
        if self._handle is not None:
            ident = self._kernel.submit(self._handle, write, file.fd, tensor.data_ptr(), nbytes, offset)
        else:
            ident = self._executor.submit(_move, write, file.fd, tensor.data_ptr(), nbytes, offset, self.block_size)
        return IORequest(self, ident, tensor, what)

    def _wait(self, ident) -> int:
        if isinstance(ident, Future):
            return ident.result()
        return self._kernel.wait(self._handle, ident)

    def close(self) -> None:
        """Finish queued requests and stop the threads."""
        if self._handle is not None:
            self._kernel.pool_free(self._handle)
            self._handle = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _move(write: bool, fd: int, ptr: int, nbytes: int, offset: int, block: int) -> int:
    """The fallback's worker: the request block by block; 0, an errno, or -1 at end of file."""
    done = 0
    while done < nbytes:
        n = min(block, nbytes - done)
        view = memoryview((ctypes.c_char * n).from_address(ptr + done)).cast("B")
        try:
            moved = os.pwritev(fd, [view], offset + done) if write else os.preadv(fd, [view], offset + done)
        except OSError as e:
            return e.errno or errno_mod.EIO
        if moved == 0:
            return -1
        done += moved
    return 0
