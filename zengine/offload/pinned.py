"""Page-locked (pinned) host buffers sized exactly, and a count of the pinned bytes zengine holds.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every request up to
a power of two and never gives the memory back to the system (pytorch issue 95823), so a 5 GiB optimizer
shard pins 8 GiB for the life of the process. The long-lived buffers (offloaded shards, copy staging,
swap buffers, checkpoint snapshots) are allocated here instead:

- on a CUDA machine, a plain (pageable) CPU allocation registered with
  ``cudaHostRegister(ptr, nbytes, 0)``: exactly ``nbytes`` are page-locked, and
  ``cudaHostUnregister`` runs when the tensor's storage is freed (the last view gone), just before
  torch frees the memory, so the registration lives exactly as long as the buffer;
- where registration fails (an unusual driver, a container limit), ``torch.empty(pin_memory=True)``,
  said once in the log; those bytes are counted rounded up to the allocator's power of two;
- without CUDA, ``torch.empty(pin_memory=True)`` as before: the CPU tests' stand-in device
  (``tests/device_guard.py``) answers it with recorded host memory. Callers ask for pinning only
  where the compute device copies from pinned memory (``copies.host_pinning``), so a CPU-only run
  never gets here with ``pin=True``.

``held()`` counts the pinned bytes alive now, by kind (``engine.memory_breakdown()["pinned_host"]`` is
their sum). Small per-step buffers (a bucket's download staging, activation checkpoints moved to the
host) stay with torch's caching allocator: it reuses them step after step, which registration could
not do cheaply (``cudaHostRegister`` costs about a second per few GiB).

Tests replace the CUDA runtime with ``RUNTIME`` (an object with ``cudaHostRegister`` and
``cudaHostUnregister``, as ``torch.cuda.cudart()`` has).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import weakref
from collections import Counter
from typing import Any, Optional, Sequence, Union

import torch

logger = logging.getLogger("zengine")

# The CUDA runtime that registers host memory: None picks torch.cuda.cudart() where CUDA is available
# (and nothing elsewhere); False never registers (torch's pinned allocator, or the CPU stand-in). Tests
# put a fake object here.
RUNTIME: Any = None

PAGE = mmap.PAGESIZE
# Kinds of pinned buffers (the keys of ``held()``).
OPTIMIZER = (
    "offloaded optimizer"  # fp32 masters and gradient shards in host memory (offload_optimizer cpu)
)
PARAMETERS = "offloaded parameters"  # stage-3 parameter shards in host memory, or their NVMe cache
STAGING = "copy staging"  # host staging of side-stream copies (CPUAdam's copy-out, uploads)
SWAP = "swap buffers"  # NVMe swap I/O buffers (optimizer states, parameters, gradients)
SNAPSHOT = "checkpoint snapshot"  # an asynchronous checkpoint's host copy
OFFLOADED_STATES = "offloaded states"  # engine.offload_states()'s host copies

_lock = (
    threading.Lock()
)  # finalizers run in whichever thread drops the last view (the checkpoint writer's)
_held: Counter = Counter()  # kind -> pinned bytes alive now
_warned = False


def held() -> dict[str, int]:
    """Pinned host bytes zengine holds now in this process, by kind (kinds with none left out)."""
    with _lock:
        return {k: v for k, v in _held.items() if v}


def held_bytes(kind: Optional[str] = None) -> int:
    """Pinned host bytes zengine holds now in this process: of ``kind``, or all of them."""
    with _lock:
        return _held[kind] if kind is not None else sum(_held.values())


def empty(
    size: Union[int, Sequence[int]],
    dtype: torch.dtype = torch.float32,
    *,
    kind: str,
    pin: bool = True,
    align: int = 0,
) -> torch.Tensor:
    """An uninitialised host tensor of shape ``size``, pinned when ``pin`` (see the module doc), counted
    under ``kind`` while it lives. ``align``: bytes its data must start on (a power of two; O_DIRECT swap
    buffers ask for 4096); registered buffers always start on a page."""
    shape = (size,) if isinstance(size, int) else tuple(size)
    numel = math.prod(int(n) for n in shape)
    itemsize = dtype.itemsize
    nbytes = numel * itemsize
    if not pin or nbytes == 0:
        return _plain(shape, dtype, align)
    runtime = _runtime()
    if runtime is not None:
        raw = _registered(nbytes, kind, runtime)
        if raw is not None:
            return raw.view(dtype).view(shape)
    if align <= itemsize:  # torch's pinned allocator (or the CPU stand-in), sized as asked
        out = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        _track(out, _pinned_size(nbytes, runtime), kind)
        return out
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device="cpu", pin_memory=True)
    _track(raw, _pinned_size(nbytes + align, runtime), kind)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def zeros(
    size: Union[int, Sequence[int]],
    dtype: torch.dtype = torch.float32,
    *,
    kind: str,
    pin: bool = True,
) -> torch.Tensor:
    """As ``empty``, filled with zeros."""
    return empty(size, dtype, kind=kind, pin=pin).zero_()


def _plain(shape: tuple, dtype: torch.dtype, align: int) -> torch.Tensor:
    """Pageable host memory of ``shape`` starting on an ``align``-byte boundary."""
    if align <= dtype.itemsize:
        return torch.empty(shape, dtype=dtype, device="cpu")
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device="cpu")
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def _runtime() -> Any:
    if RUNTIME is not None:
        return RUNTIME or None
    return torch.cuda.cudart() if torch.cuda.is_available() else None


def _code(result: Any) -> int:
    """A cudaError as an int (torch's binding returns an enum member; a fake may return an int)."""
    return int(getattr(result, "value", result))


def _registered(nbytes: int, kind: str, runtime: Any) -> Optional[torch.Tensor]:
    """[nbytes] uint8 pageable memory registered with ``runtime`` (page-aligned start), or None if the
    registration failed (logged once)."""
    global _warned
    # Two pages of slack: the registered range starts on a page and its last page lies inside this
    # allocation, so no other buffer shares a registered page (the driver refuses overlapping ranges,
    # and a neighbour's free must not take pages a registration covers).
    raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8, device="cpu")
    skip = -raw.data_ptr() % PAGE
    ptr = raw.data_ptr() + skip
    code = _code(runtime.cudaHostRegister(ptr, nbytes, 0))
    if code != 0:
        _clear_error(runtime)
        if not _warned:
            _warned = True
            logger.warning(
                "cudaHostRegister of %d bytes failed (cudaError %d); pinned host buffers fall back to "
                "torch's pinned allocator, which rounds each up to a power of two and keeps it "
                "until the process ends",
                nbytes,
                code,
            )
        return None
    with _lock:
        _held[kind] += nbytes
    # Tied to the storage, not to this tensor: views keep the storage, and the finalizer runs as the last
    # one goes, before torch frees the memory (an unregister after the free could hit reused memory).
    done = weakref.finalize(raw.untyped_storage(), _unregister, runtime, ptr, nbytes, kind)
    done.atexit = False  # at exit the process's memory goes anyway; no CUDA calls during teardown
    return raw[skip : skip + nbytes]


def _unregister(runtime: Any, ptr: int, nbytes: int, kind: str) -> None:
    code = _code(runtime.cudaHostUnregister(ptr))
    if code != 0:
        _clear_error(runtime)
        logger.warning(
            "cudaHostUnregister of %d bytes at 0x%x failed (cudaError %d)", nbytes, ptr, code
        )
    with _lock:
        _held[kind] -= nbytes


def _track(t: torch.Tensor, nbytes: int, kind: str) -> None:
    """Count ``nbytes`` under ``kind`` until ``t``'s storage is freed."""
    with _lock:
        _held[kind] += nbytes
    weakref.finalize(t.untyped_storage(), _forget, nbytes, kind).atexit = False


def _forget(nbytes: int, kind: str) -> None:
    with _lock:
        _held[kind] -= nbytes


def _pinned_size(nbytes: int, runtime: Any) -> int:
    """Bytes torch's pinned allocator takes for ``nbytes``: its CUDA caching allocator rounds up to a power
    of two; the stand-in (no runtime) takes what was asked."""
    return 1 << max(nbytes - 1, 0).bit_length() if runtime is not None else nbytes


def _clear_error(runtime: Any) -> None:
    """Reset the CUDA runtime's last error after a failed call: torch's binding leaves it set, and torch's
    next kernel-launch check would raise it as its own. Best effort (torch exposes no cudaGetLastError)."""
    get_last = getattr(runtime, "cudaGetLastError", None)
    if get_last is None and RUNTIME is None:  # torch's binding: the library it loaded
        get_last = _cudart_get_last_error()
    if get_last is not None:
        try:
            get_last()
        except Exception:  # noqa: BLE001 - nothing to do if the library is not the one torch loaded
            pass


def _cudart_get_last_error() -> Optional[Any]:
    """``cudaGetLastError`` of the CUDA runtime torch loaded (found by name among loaded libraries)."""
    for name in (None, "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"):
        try:
            return ctypes.CDLL(
                name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL
            ).cudaGetLastError
        except (OSError, AttributeError):
            continue
    return None
