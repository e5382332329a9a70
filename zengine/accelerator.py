"""``zengine.accelerator.get_accelerator()``: DeepSpeed's device abstraction, for CUDA and the CPU.

    from zengine.accelerator import get_accelerator   # DeepSpeed: deepspeed.accelerator
    device = get_accelerator().device_name(local_rank)  # "cuda:0", or "cpu" on a CPU-only machine
    x = x.to(get_accelerator().current_device_name())

DeepSpeed's public name (``deepspeed.accelerator``) over ``zengine.device``, where the
accelerators live: which one is chosen (``device/current.py``: the engine's own device, or
``DS_ACCELERATOR``), and what the CPU's members mean (``device/host.py``).
"""

from .device import Accelerator, CpuAccelerator, CudaAccelerator, get_accelerator, set_accelerator

# their names here before zengine/device/ (tests/offload subclass _HostStream)
from .device.host import HostEvent as _HostEvent, HostStream as _HostStream  # noqa: F401

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "set_accelerator"]
