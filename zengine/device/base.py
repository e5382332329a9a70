"""``Accelerator``: what DeepSpeed scripts call on ``get_accelerator()``, for every device."""

from __future__ import annotations

from typing import Optional

import torch


class Accelerator:
    """The members DeepSpeed scripts call on ``get_accelerator()``; subclasses per device type.

    Each subclass also has: ``device_count()``, ``current_device()``, ``set_device(i)``,
    ``synchronize(i)``, ``get_rng_state()``/``set_rng_state()``, ``Stream``, ``Event``,
    ``stream(s)``, ``current_stream()``, ``default_stream()``, ``empty_cache()``,
    ``memory_allocated()``, ``max_memory_allocated()``, ``memory_reserved()``,
    ``max_memory_reserved()``, ``reset_peak_memory_stats()``, ``total_memory()``,
    ``available_memory()``, ``memory_stats()``: DeepSpeed's names, with torch.cuda's meanings on
    CUDA (see ``CpuAccelerator`` for the CPU).
    """

    name = "base"

    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"`` / ``"cuda:N"``; ``"cpu"`` (the CPU has no index)."""
        raise NotImplementedError

    def device(self, device_index: Optional[int] = None) -> torch.device:
        """``device_name(device_index)`` as a ``torch.device``."""
        return torch.device(self.device_name(device_index))

    def current_device_name(self) -> str:
        """The name of the device this process computes on."""
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device (``nccl``, ``gloo``)."""
        raise NotImplementedError

    def is_available(self) -> bool:
        """Whether this device type is usable in this process."""
        raise NotImplementedError

    def is_bf16_supported(self) -> bool:
        """Whether the device computes in bfloat16."""
        raise NotImplementedError

    def is_fp16_supported(self) -> bool:
        """Whether the device computes in float16."""
        raise NotImplementedError

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating dtypes the device computes in (float32 always)."""
        return [torch.float32] + [
            d
            for d, ok in (
                (torch.bfloat16, self.is_bf16_supported()),
                (torch.float16, self.is_fp16_supported()),
            )
            if ok
        ]

    def is_synchronized_device(self) -> bool:
        """True when work runs in program order (the CPU), so streams and events order nothing."""
        return False

    def random(self):
        """torch's random module (DeepSpeed's member)."""
        return torch.random

    def manual_seed(self, seed: int) -> None:
        """Seed this device's default generator."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed the default generator of every device of this type."""
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """The seed of this device's default generator."""
        return torch.initial_seed()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator."""
        return tensor.device.type == self.name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` in page-locked host memory where the device has such memory; else itself."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def range_push(self, msg: str) -> None:
        """Open a profiler range (NVTX on CUDA)."""

    def range_pop(self) -> None:
        """Close the innermost profiler range."""


def reuses_freed_blocks(device: torch.device) -> bool:
    """Whether ``device``'s allocator keeps freed blocks for the next allocations (a GPU's caching
    allocator, counted by ``max_memory_allocated`` only while in use), so that zengine need not pool
    its own buffers there; the host's returns large blocks to the system and faults every page in
    again on the next use, so buffers that come back every step are kept there."""
    return device.type != "cpu"
