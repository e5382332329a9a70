"""``zengine.accelerator.get_accelerator()``: DeepSpeed's device abstraction, for CUDA and for the CPU.

    from zengine.accelerator import get_accelerator   # DeepSpeed: from deepspeed.accelerator import ...
    device = get_accelerator().device_name(local_rank)  # "cuda:0", or "cpu" on a CPU-only machine
    x = x.to(get_accelerator().current_device_name())

Which one: the device the engine computes on, chosen the same way
(``zengine.distributed.resolve_device``): CUDA when the process group's
backend computes there, or, before a process group exists, when CUDA is
available and ``ZENGINE_DEVICE`` does not say ``cpu``; else the CPU.
``DS_ACCELERATOR`` (DeepSpeed's variable: ``cuda`` or ``cpu``) forces one.
On the CPU the memory figures are the process's resident set (there is no
allocator to ask), ``Stream``/``Event`` are stand-ins that order nothing
(CPU work is already in program order) and synchronising does nothing.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Optional, Union

import torch

_accelerator: Optional["Accelerator"] = None


class Accelerator:
    """The members DeepSpeed scripts call on ``get_accelerator()``; subclasses per device type."""

    name = "base"

    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"`` / ``"cuda:N"``; ``"cpu"`` (the CPU has no index)."""
        raise NotImplementedError

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device (``nccl``, ``gloo``)."""
        raise NotImplementedError

    def is_available(self) -> bool:
        raise NotImplementedError

    def is_bf16_supported(self) -> bool:
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        raise NotImplementedError

    # Each subclass also has: device_count(), current_device(), set_device(i), synchronize(i),
    # get_rng_state()/set_rng_state(), Stream, Event, stream(s), current_stream(), default_stream(),
    # empty_cache(), memory_allocated(), max_memory_allocated(), memory_reserved(),
    # max_memory_reserved(), reset_peak_memory_stats(), total_memory(), available_memory(),
    # memory_stats(): DeepSpeed's names, with torch.cuda's meanings on CUDA (see CpuAccelerator for the CPU).

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32] + [d for d, ok in ((torch.bfloat16, self.is_bf16_supported()),
                                                  (torch.float16, self.is_fp16_supported())) if ok]

    def is_synchronized_device(self) -> bool:
        """True when work runs in program order (the CPU), so streams and events order nothing."""
        return False

    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator."""
        return tensor.device.type == self.name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def range_push(self, msg: str) -> None:
        """Open a profiler range (NVTX on CUDA)."""

    def range_pop(self) -> None:
        """Close the innermost profiler range."""


class CudaAccelerator(Accelerator):
    """CUDA devices through ``torch.cuda``."""

    name = "cuda"

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: Union[int, str, torch.device]) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: Optional[int] = None) -> None:
        torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return torch.cuda.is_available()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name: get_accelerator().Stream(...))
        return torch.cuda.Stream

    @property
    def Event(self):  # noqa: N802
        return torch.cuda.Event

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Optional[int] = None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Optional[int] = None):
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()


class _HostStream:
    """Stands in for a CUDA stream on the CPU: work already runs in program order."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or _HostEvent()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _HostEvent:
    """Stands in for a CUDA event on the CPU: records the wall-clock time, for ``elapsed_time``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.time: Optional[float] = None

    def record(self, stream=None) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        """Milliseconds from this event to ``end``."""
        return (end.time - self.time) * 1000.0


def _resident_bytes(field: str) -> int:
    """VmRSS / VmHWM of this process in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CpuAccelerator(Accelerator):
    """The CPU: gloo, program order, the process's resident memory."""

    name = "cpu"

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cpu"

    def device_count(self) -> int:
        # DeepSpeed counts one "device" per rank on a CPU node; the local world size says how many.
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def current_device(self) -> int:
        from .distributed.process_group import local_rank  # imported late, as in _choose

        return local_rank()

    def current_device_name(self) -> str:
        return "cpu"

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index: Optional[int] = None) -> None:
        pass

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return True

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True  # CPU matmuls take float16 in torch 2.x (slowly); zengine's fp16 path runs on CPU

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        torch.set_rng_state(new_state)

    Stream = _HostStream
    Event = _HostEvent

    def stream(self, stream):
        return nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> _HostStream:
        return _HostStream()

    def default_stream(self, device_index: Optional[int] = None) -> _HostStream:
        return _HostStream()

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return _resident_bytes("VmRSS")

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return _resident_bytes("VmHWM")

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        try:  # the kernel resets VmHWM to the current resident set
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    reset_max_memory_allocated = reset_peak_memory_stats

    def total_memory(self, device_index: Optional[int] = None) -> int:
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: Optional[int] = None) -> int:
        import psutil

        return psutil.virtual_memory().available

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        return {"allocated_bytes.all.current": self.memory_allocated(), "allocated_bytes.all.peak":
                self.max_memory_allocated()}


def _choose() -> Accelerator:
    forced = os.environ.get("DS_ACCELERATOR")
    if forced:
        if forced not in ("cuda", "cpu"):
            raise ValueError(f"DS_ACCELERATOR={forced!r}: zengine has the 'cuda' and 'cpu' accelerators")
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda but torch sees no CUDA device")
        return CudaAccelerator() if forced == "cuda" else CpuAccelerator()
    import torch.distributed as dist

    from .distributed.process_group import DEVICE_ENV, local_rank, resolve_device

    if dist.is_available() and dist.is_initialized():
        device = resolve_device(dist.get_backend(), local_rank())
        return CudaAccelerator() if device.type == "cuda" else CpuAccelerator()
    wants_cpu = os.environ.get(DEVICE_ENV, "").startswith("cpu")
    return CudaAccelerator() if torch.cuda.is_available() and not wants_cpu else CpuAccelerator()


def get_accelerator() -> Accelerator:
    """The accelerator this process computes on (chosen once, on first call; see the module doc)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = _choose()
    return _accelerator


def set_accelerator(accel: Accelerator) -> None:
    """Use ``accel`` from now on (DeepSpeed's name)."""
    global _accelerator
    _accelerator = accel
