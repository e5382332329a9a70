"""The compute device's runtime: streams, events, memory figures, seeds and pinning, for CUDA and
for the CPU, behind one ``Accelerator`` interface (DeepSpeed's ``get_accelerator()`` members).

``base.py`` declares the interface, ``cuda.py`` and ``host.py`` implement it, ``current.py``
chooses the one this process computes on. ``zengine.accelerator`` is DeepSpeed's public face of
this package (``deepspeed.accelerator``); code inside zengine imports from here.
"""

from .base import Accelerator, reuses_freed_blocks
from .cuda import CudaAccelerator
from .current import get_accelerator, set_accelerator
from .host import CpuAccelerator, HostEvent, HostStream

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "HostEvent",
    "HostStream",
    "get_accelerator",
    "set_accelerator",
    "reuses_freed_blocks",
]
