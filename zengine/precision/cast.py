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
    """Move the module to ``device`` with floating parameters and buffers in ``dtype``.

    Parameters keep their identity (their ``.data`` moves), so param groups built from them stay
    valid; unlike ``module.to`` this also works on tensor subclasses such as the fake CUDA tensors
    of the CPU guard tests.
    """
    def moved(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and (p.device != device or (p.is_floating_point() and p.dtype != dtype)):
                    p.data = moved(p.data)
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = moved(b)
