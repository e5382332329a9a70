"""Which accelerator this process computes on: ``get_accelerator()``, chosen once.

The device the engine computes on, chosen the same way (``zengine.distributed.resolve_device``):
CUDA when the process group's backend computes there, or, before a process group exists, when
CUDA is available and ``ZENGINE_DEVICE`` does not say ``cpu``; else the CPU. ``DS_ACCELERATOR``
(DeepSpeed's variable: ``cuda`` or ``cpu``) forces one.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed.process_group import DEVICE_ENV, local_rank, resolve_device
from .base import Accelerator
from .cuda import CudaAccelerator
from .host import CpuAccelerator

_accelerator: Optional[Accelerator] = None


def _choose() -> Accelerator:
    forced = os.environ.get("DS_ACCELERATOR")
    if forced:
        if forced not in ("cuda", "cpu"):
            raise ValueError(
                f"DS_ACCELERATOR={forced!r}: zengine has the 'cuda' and 'cpu' accelerators"
            )
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda but torch sees no CUDA device")
        return CudaAccelerator() if forced == "cuda" else CpuAccelerator()
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
