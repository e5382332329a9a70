"""The compute precision: which dtype the model runs in and how inputs are cast."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn


def cast_floating(obj: Any, dtype: torch.dtype, casts: Optional[list] = None) -> Any:
    """Cast every floating-point tensor in a (nested) input structure to ``dtype``.

    A structure with nothing to cast comes back as the same object, and a list or dict is cast in
    place: a model may fill a container it is given (a KV cache passed as a list or dict), and the
    caller must see what it wrote, as it would calling the model itself. Tuples are rebuilt only
    when an element changed. ``casts`` collects (original, cast, its version) for each tensor cast,
    so that ``write_back`` can hand the model's in-place writes to the caller's tensors."""
    if torch.is_tensor(obj):
        if not obj.is_floating_point() or obj.dtype == dtype:
            return obj
        cast = obj.to(dtype)
        if casts is not None:
            casts.append((obj, cast, cast._version))
        return cast
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            cast = cast_floating(item, dtype, casts)
            if cast is not item:
                obj[i] = cast
        return obj
    if isinstance(obj, dict):
        for key, item in obj.items():
            cast = cast_floating(item, dtype, casts)
            if cast is not item:
                obj[key] = cast
        return obj
    if isinstance(obj, tuple):
        cast = [cast_floating(o, dtype, casts) for o in obj]
        if all(c is o for c, o in zip(cast, obj)):
            return obj
        return type(obj)(*cast) if hasattr(obj, "_fields") else type(obj)(cast)
    return obj


@contextlib.contextmanager
def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype):
    """Inside: a forward's arguments cast (``cast_floating``), as ``(args, kwargs)``; on the way
    out the model's in-place writes to cast inputs reach the caller's tensors (``write_back``)."""
    casts: list = []
    try:
        yield cast_floating(args, dtype, casts), cast_floating(kwargs, dtype, casts)
    finally:
        write_back(casts)


def write_back(casts: list) -> None:
    """After the forward: each cast input the model wrote in place (a buffer it fills, in a tuple or
    on its own) is copied into the caller's tensor, in its dtype, as the model's ``copy_`` into the
    caller's tensor would have written it without the cast. One version read per cast input."""
    with torch.no_grad():
        for original, cast, version in casts:
            if cast._version != version:
                original.copy_(cast)


def cast_module(
    module: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    buffer_dtype: Optional[torch.dtype] = None,
) -> None:
    """Move the module to ``device`` with floating parameters in ``dtype`` and floating buffers in
    ``buffer_dtype`` (None: ``dtype``; ``data_types.buffer_dtype``).

    Parameters keep their identity (their ``.data`` moves), so param groups built from them stay
    valid; unlike ``module.to`` this also works on tensor subclasses such as the fake CUDA tensors
    of the CPU guard tests.
    """

    def moved(t: torch.Tensor, to: torch.dtype = dtype) -> torch.Tensor:
        return t.to(device=device, dtype=to if t.is_floating_point() else None)

    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None and (
                    p.device != device or (p.is_floating_point() and p.dtype != dtype)
                ):
                    p.data = moved(p.data)
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = moved(b, buffer_dtype or dtype)
