"""Fused gradient pass for mixed precision: unscale, sum of squares, non-finite check.

One read (and, when unscaling, one write) of each fp32 CPU gradient gives what the loss
scaler and gradient clipping need: the gradient divided by the loss scale, its squared L2
norm, and whether any element is inf or NaN. The squares are summed in double, where a
float squared is exact and cannot overflow, so the sum is finite exactly when every value is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .builder import load_op

__all__ = ["GradStats", "sum_of_squares", "unscale_and_norm_"]

# Elements per chunk of the torch fallback on a device: bounds its float64 temporary.
_FALLBACK_CHUNK = 1 << 22
# On the CPU (the bf16 gradient shards of bf16 masters come this way), 2 MiB of float64 a chunk:
# 4M-element chunks were the largest transient of a bf16-master step (1.8 bytes per parameter at
# W=2), and a CPU pays little per chunk.
_CPU_FALLBACK_CHUNK = 1 << 18


class GradStats(NamedTuple):
    """What one pass over the gradients found."""

    sum_sq: float  # sum of squares of the (unscaled) gradients; inf/nan when found_inf
    found_inf: bool  # some element is inf or NaN

    @property
    def norm(self) -> float:
        return math.sqrt(self.sum_sq)


def _torch_sum_sq_(grad: torch.Tensor, inv_scale: float) -> float:
    flat = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1)
    if inv_scale != 1.0:
        grad.mul_(inv_scale)
        flat = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1)
    total = 0.0
    step = _CPU_FALLBACK_CHUNK if flat.device.type == "cpu" else _FALLBACK_CHUNK
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].to(torch.float64)
        total += float(torch.dot(chunk, chunk))
    return total


@torch.no_grad()
def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of ``t`` as a 0-dim float64 tensor on ``t``'s device, with no host read and
    no full-size temporary (``vector_norm(t, dtype=float64)`` converts the whole tensor first: twice
    an fp32 gradient shard's bytes, the largest transient of a step).

    On the CPU: ``unscale_and_norm_`` (the compiled op for fp32, bounded chunks otherwise); on a
    device: float64 chunks of a bounded size, summed there.
    """
    if t.device.type == "cpu":
        return torch.tensor(unscale_and_norm_(t).sum_sq, dtype=torch.float64)
    flat = t.reshape(-1)
    chunk = max(_FALLBACK_CHUNK, -(-flat.numel() // 64))  # at most 64 pieces: few kernels on a GPU
    parts = [
        torch.linalg.vector_norm(flat[i : i + chunk], dtype=torch.float64).square()
        for i in range(0, flat.numel(), chunk)
    ]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


@torch.no_grad()
def unscale_and_norm_(
    grads: torch.Tensor | Sequence[torch.Tensor], inv_scale: float = 1.0, simd: str | None = None
) -> GradStats:
    """Multiply each gradient by ``inv_scale`` in place (skipped when 1) and return the sum of
    squares of the results and whether any is non-finite.

    Contiguous fp32 CPU tensors go through the compiled ``unscale_norm`` op; others (other
    dtypes, devices) through torch ops. ``simd`` forces a kernel path, as in ``adam_step_``.
    """
    from .adam import _SIMD_CODES

    tensors = [grads] if isinstance(grads, torch.Tensor) else list(grads)
    total = 0.0
    for grad in tensors:
        kernel = None
        if grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous():
            kernel = load_op("unscale_norm")
        if kernel is None:
            total += _torch_sum_sq_(grad, inv_scale)
        else:
            total += kernel.unscale_sum_squares(
                grad.data_ptr(),
                grad.numel(),
                float(inv_scale),
                torch.get_num_threads(),
                _SIMD_CODES[simd],
            )
    return GradStats(total, not math.isfinite(total))
