"""``CpuAccelerator``: DeepSpeed's accelerator members for a rank that computes on the CPU.

On the CPU the memory figures are the process's resident set (there is no allocator to ask),
``Stream``/``Event`` are stand-ins that order nothing (CPU work is already in program order) and
synchronising does nothing.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Optional

import torch

from ..distributed.process_group import local_rank
from .base import Accelerator


class HostStream:
    """Stands in for a CUDA stream on the CPU: work already runs in program order."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream) -> None:
        """Nothing to order."""

    def wait_event(self, event) -> None:
        """Nothing to order."""

    def record_event(self, event=None) -> "HostEvent":
        """Record ``event`` (a new one when None) now and return it."""
        event = event or HostEvent()
        event.record()
        return event

    def query(self) -> bool:
        """Always done."""
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class HostEvent:
    """Stands in for a CUDA event on the CPU: records the wall-clock time, for ``elapsed_time``."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ):
        self.time: Optional[float] = None

    def record(self, stream=None) -> None:
        """Note the wall-clock time."""
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream=None) -> None:
        """Nothing to order."""

    def query(self) -> bool:
        """Always done."""
        return True

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to ``end``."""
        return (end.time - self.time) * 1000.0


def resident_bytes(field: str) -> int:
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
        """One "device" per rank on the node."""
        # DeepSpeed counts one "device" per rank on a CPU node; the local world size says how many.
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def current_device(self) -> int:
        """This rank's index on its node."""
        return local_rank()

    def current_device_name(self) -> str:
        return "cpu"

    def set_device(self, device_index) -> None:
        """Nothing to select."""

    def synchronize(self, device_index: Optional[int] = None) -> None:
        """Nothing to wait for: program order."""

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return True

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        # CPU matmuls take float16 in torch 2.x (slowly); zengine's fp16 path runs on CPU
        return True

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        """The CPU generator's state."""
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        """Restore the CPU generator's state."""
        torch.set_rng_state(new_state)

    Stream = HostStream
    Event = HostEvent

    def stream(self, stream):
        """A context that changes nothing."""
        return nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> HostStream:
        """A stand-in stream."""
        return HostStream()

    def default_stream(self, device_index: Optional[int] = None) -> HostStream:
        """A stand-in stream."""
        return HostStream()

    def empty_cache(self) -> None:
        """No cache to empty."""

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """The process's resident set."""
        return resident_bytes("VmRSS")

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        """The peak of the process's resident set."""
        return resident_bytes("VmHWM")

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        """Start the resident peak anew."""
        try:  # the kernel resets VmHWM to the current resident set
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    reset_max_memory_allocated = reset_peak_memory_stats

    def total_memory(self, device_index: Optional[int] = None) -> int:
        """The host's memory in bytes."""
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: Optional[int] = None) -> int:
        """The host's available memory in bytes."""
        import psutil

        return psutil.virtual_memory().available

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        """The resident set as torch's allocator statistics' two keys."""
        return {
            "allocated_bytes.all.current": self.memory_allocated(),
            "allocated_bytes.all.peak": self.max_memory_allocated(),
        }
