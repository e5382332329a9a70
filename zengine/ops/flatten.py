"""Flatten a list of tensors into one buffer, and copy a buffer back into the list.

On CPU the compiled ``flatten`` op copies with all threads, splitting the total bytes evenly
(many small tensors and a few large ones balance alike); elsewhere, or without the op,
``torch.cat`` / ``copy_`` do the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .builder import load_op

__all__ = ["flatten", "unflatten_into"]

_INTO_FLAT, _OUT_OF_FLAT = 0, 1


def _kernel_for(flat: torch.Tensor, tensors: Sequence[torch.Tensor]):
    if flat.device.type != "cpu" or not flat.is_contiguous():
        return None
    if not all(
        t.device.type == "cpu" and t.dtype == flat.dtype and t.is_contiguous() for t in tensors
    ):
        return None
    return load_op("flatten")


def _check_same_dtype(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise TypeError(f"tensor {i} is {t.dtype}, expected {dtype}")


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the tensors' elements (in order) into one 1-D tensor.

    Args:
        tensors: tensors of one dtype and device, any shapes.
        out: optional 1-D destination with at least the total number of elements; the
            elements past the total (padding) are left as they are.
    Returns:
        ``out``, or a new tensor of exactly the total number of elements.
    """
    tensors = list(tensors)
    total = sum(t.numel() for t in tensors)
    if out is None:
        if not tensors:
            return torch.empty(0)
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    if out.dim() != 1 or out.numel() < total:
        raise ValueError(
            f"out must be 1-D with at least {total} elements, got shape {tuple(out.shape)}"
        )
    _check_same_dtype(tensors, out.dtype)
    kernel = _kernel_for(out, tensors)
    if kernel is None:
        if tensors:
            torch.cat([t.reshape(-1) for t in tensors], out=out[:total])
        return out
    nonempty = [t for t in tensors if t.numel()]
    kernel.copy_flat(
        out.data_ptr(),
        [t.data_ptr() for t in nonempty],
        [t.numel() * t.element_size() for t in nonempty],
        _INTO_FLAT,
        torch.get_num_threads(),
    )
    return out


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive elements of 1-D ``flat`` back into each tensor, in place (the inverse
    of ``flatten``); ``flat`` may be longer (padding is ignored)."""
    tensors = list(tensors)
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() < total:
        raise ValueError(
            f"flat must be 1-D with at least {total} elements, got shape {tuple(flat.shape)}"
        )
    _check_same_dtype(tensors, flat.dtype)
    kernel = _kernel_for(flat, tensors)
    if kernel is None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return
    nonempty = [t for t in tensors if t.numel()]
    kernel.copy_flat(
        flat.data_ptr(),
        [t.data_ptr() for t in nonempty],
        [t.numel() * t.element_size() for t in nonempty],
        _OUT_OF_FLAT,
        torch.get_num_threads(),
    )
