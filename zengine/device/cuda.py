"""``CudaAccelerator``: DeepSpeed's accelerator members over ``torch.cuda``."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .base import Accelerator


class CudaAccelerator(Accelerator):
    """CUDA devices through ``torch.cuda``."""

    name = "cuda"

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device_count(self) -> int:
        """The visible CUDA devices."""
        return torch.cuda.device_count()

    def current_device(self) -> int:
        """torch's current CUDA device index."""
        return torch.cuda.current_device()

    def set_device(self, device_index: Union[int, str, torch.device]) -> None:
        """Make ``device_index`` torch's current CUDA device."""
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: Optional[int] = None) -> None:
        """Wait for the device's queued work."""
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
        """The device generator's state."""
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        """Restore the device generator's state."""
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name: get_accelerator().Stream(...))
        """``torch.cuda.Stream``."""
        return torch.cuda.Stream

    @property
    def Event(self):  # noqa: N802
        """``torch.cuda.Event``."""
        return torch.cuda.Event

    def stream(self, stream):
        """Context manager: queue work on ``stream``."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Optional[int] = None):
        """The stream work is queued on now."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Optional[int] = None):
        """The device's default stream."""
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        """Return the allocator's unused cached blocks to the device."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """Bytes held by tensors now."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        """The peak of ``memory_allocated`` since the last reset."""
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        """Bytes the caching allocator holds now."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        """The peak of ``memory_reserved`` since the last reset."""
        return torch.cuda.max_memory_reserved(device_index)

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        """Start the peaks anew from the current figures."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        """DeepSpeed's older name of ``reset_peak_memory_stats``."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        """The device's memory in bytes."""
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: Optional[int] = None) -> int:
        """The device's free memory in bytes."""
        return torch.cuda.mem_get_info(device_index)[0]

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        """torch's allocator statistics."""
        return torch.cuda.memory_stats(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()
