"""The compute precision: which dtype the model runs in and how inputs are cast."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a (nested) input structure to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        cast = [cast_floating(o, dtype) for o in obj]
        return type(obj)(*cast) if hasattr(obj, "_fields") else type(obj)(cast)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def cast_module(module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Move the module to ``device`` with floating parameters and buffers in ``dtype``."""
    module.to(device=device)
    if dtype != torch.float32:
        module.to(dtype=dtype)
