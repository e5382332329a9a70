"""A linear layer whose matrix multiplies run in fp32 on bf16 tensors: bf16 in, bf16 out, bf16 gradients.

On a CPU without native bf16 arithmetic, torch's bf16 GEMM is emulated and slow in every layout, and
slowest by far in the input-gradient product ``grad @ weight`` (measured 0.5 GFLOP/s against 86 in
fp32 on an AVX2 server). ``Fp32Linear`` upcasts the operands of each product to fp32, multiplies
there, and rounds the product to bf16, which is what a native bf16 GEMM does too (fp32 accumulation,
one rounding of the result), so values match torch's bf16 linear up to the order of the sums.

What autograd keeps for backward is what ``F.linear`` keeps: the bf16 input and the weight parameter
itself (not a copy), so that ZeRO stage 3, which swaps a parameter's ``.data`` between gathered and
released, hands backward the gathered weight when its hooks have fetched it again.

The fp32 copies of the weight are made in one reusable buffer (``Fp32Scratch``): a fresh allocation
of a large matrix costs page faults (every time, when glibc hands large blocks back to the system),
which for a few tokens per step costs more than the product itself.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class Fp32Scratch:
    """One grow-only fp32 buffer [numel] for the upcast weight and the fp32 weight gradient of one
    product at a time (autograd runs a CPU graph's nodes one after another on one thread)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.float32)  # [largest weight numel seen]

    def take(self, shape: torch.Size) -> torch.Tensor:
        """An uninitialised fp32 tensor of ``shape`` over the buffer (valid until the next ``take``)."""
        numel = shape.numel()
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=torch.float32)
        return self.buffer[:numel].view(shape)

    def upcast(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` in fp32, in the buffer."""
        return self.take(weight.shape).copy_(weight)

    def nbytes(self) -> int:
        """Bytes the buffer holds now."""
        return self.buffer.numel() * 4


class Fp32Linear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for bf16 tensors, each product computed in fp32 and rounded to bf16.

    ``apply(x [..., in], weight [out, in], bias [out] or None, scratch) -> [..., out]`` in ``x.dtype``;
    the gradients come back in the dtypes of ``x``, ``weight`` and ``bias``.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        scratch: Fp32Scratch,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.scratch = scratch
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)  # [tokens, out]
        if bias is None:
            torch.mm(rows, scratch.upcast(weight).t(), out=out)
        else:
            torch.addmm(bias.float(), rows, scratch.upcast(weight).t(), out=out)
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        scratch: Fp32Scratch = ctx.scratch
        grad_rows = grad.reshape(-1, grad.shape[-1]).float()  # [tokens, out]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_rows @ scratch.upcast(weight)).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[
            1
        ]:  # the scratch is free again: the fp32 weight gradient goes there
            full = scratch.take(weight.shape)
            torch.mm(grad_rows.t(), x.reshape(-1, x.shape[-1]).float(), out=full)
            grad_weight = full.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0).to(weight.dtype)
        return grad_x, grad_weight, grad_bias, None


def fp32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], scratch: Fp32Scratch
) -> torch.Tensor:
    """``F.linear`` with the product in fp32 when the operands are bf16 on the CPU; as ``F.linear``
    otherwise (another dtype, a tensor subclass, a device other than the CPU)."""
    if (
        x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and (bias is None or bias.dtype is torch.bfloat16)
    ):
        return Fp32Linear.apply(x, weight, bias, scratch)
    return F.linear(x, weight, bias)
