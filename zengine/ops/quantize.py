"""Blockwise int8 / int4 quantization: the codec of ZeRO++'s quantized gathers and gradient reductions.

A row of ``n`` values is cut into blocks of ``block`` elements (the last zero-padded). Each block gets one
fp32 scale, its largest magnitude divided by ``qmax`` (127 for int8, 7 for int4), and each value becomes
``round(x / scale)`` (half to even; a zero scale divides by 1) clamped to ``[-qmax, qmax]``: the error of a
decoded element is at most half a step, ``max|block| / (2 * qmax)``. int8 codes are stored as ``int8``;
int4 codes two per ``uint8``, element ``2i`` in the low nibble and ``2i + 1`` in the high one, each stored
as ``code + 8``.

On the CPU the compiled ``quantize`` op (csrc/quantize) does this with SIMD and all threads; anything else
(a device tensor, another float dtype, a failed build) runs the same operations as torch ops on the
tensors' own device, so a device tensor never visits the host. The two give the same bits on finite
input: the kernel divides (never multiplies by a reciprocal), rounds half to even, and converts to bf16 or
fp16 with the same rounding as torch. A block holding inf or NaN decodes to non-finite values on both
paths (its scale is non-finite), though not necessarily the same ones.
"""

from __future__ import annotations

import torch

from .builder import load_op

__all__ = ["BLOCK", "quantize_blocks", "dequantize_blocks", "dequantize_sum", "code_columns"]

BLOCK = 256  # default elements per scale
_QMAX = {8: 127.0, 4: 7.0}
_TYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
}  # csrc/quantize/quantize.h FloatType


def code_columns(n: int, bits: int = 8, block: int = BLOCK) -> tuple[int, int]:
    """(code columns, scale columns) of one quantized row of ``n`` values: int8 codes are one per padded
    element, int4 codes one byte per two."""
    _check_format(bits, block)
    blocks = -(-n // block)
    return blocks * block * bits // 8, blocks


def _check_format(bits: int, block: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if block <= 0 or (bits == 4 and block % 2):
        raise ValueError(f"block must be positive (and even for int4), got {block}")


def _rows_ok(t: torch.Tensor) -> bool:
    """A CPU tensor of 2 dims whose rows are contiguous and do not overlap (any row stride), as the kernel
    reads and writes them."""
    rows, cols = t.shape if t.dim() == 2 else (0, 0)
    return (
        t.device.type == "cpu"
        and t.dim() == 2
        and (cols <= 1 or t.stride(1) == 1)
        and (rows <= 1 or t.stride(0) >= cols)
    )


def _kernel(*tensors: torch.Tensor):
    """The compiled op when every tensor suits it (CPU, rows contiguous), else None: use torch."""
    if not all(_rows_ok(t) for t in tensors):
        return None
    return load_op("quantize")


def _simd_code(simd: str | None) -> int:
    from .adam import _SIMD_CODES

    return _SIMD_CODES[simd]


@torch.no_grad()
def quantize_blocks(
    x: torch.Tensor,
    bits: int = 8,
    block: int = BLOCK,
    codes: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    simd: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([n], or [rows, n]; any float dtype) as blockwise codes and fp32 scales.

    Returns (codes, scales): int8 ``[rows, blocks * block]`` (bits 8) or uint8 ``[rows, blocks * block / 2]``
    (bits 4), and fp32 ``[rows, blocks]``; without the rows dimension when ``x`` is 1-D. ``codes`` and
    ``scales`` may be given (those shapes and dtypes, e.g. rows of a send buffer) to be written in place.
    ``simd`` forces a kernel path, as in ``adam_step_``.
    """
    _check_format(bits, block)
    flat = x.dim() == 1
    x2 = x.view(1, -1) if flat else x
    rows, n = x2.shape
    ncodes, blocks = code_columns(n, bits, block)
    code_dtype = torch.int8 if bits == 8 else torch.uint8
    if codes is None:
        codes = torch.empty(rows, ncodes, dtype=code_dtype, device=x.device)
    if scales is None:
        scales = torch.empty(rows, blocks, dtype=torch.float32, device=x.device)
    codes2, scales2 = (
        codes.view(rows, ncodes),
        scales.view(rows, blocks),
    )  # a view: written in place
    if codes2.dtype != code_dtype or scales2.dtype != torch.float32:
        raise TypeError(
            f"codes must be {code_dtype} and scales float32, got {codes.dtype} and {scales.dtype}"
        )
    kernel = _kernel(x2, codes2, scales2) if x.dtype in _TYPE_CODES else None
    if kernel is None:
        _torch_quantize(x2, bits, block, codes2, scales2)
    elif rows and n:
        kernel.quantize(
            x2.data_ptr(),
            _TYPE_CODES[x.dtype],
            x2.stride(0),
            codes2.data_ptr(),
            scales2.data_ptr(),
            rows,
            n,
            block,
            bits,
            codes2.stride(0),
            scales2.stride(0),
            torch.get_num_threads(),
            _simd_code(simd),
        )
    return (codes2.view(-1), scales2.view(-1)) if flat else (codes2, scales2)


@torch.no_grad()
def dequantize_blocks(
    codes: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    out: torch.Tensor,
    bits: int = 8,
    block: int = BLOCK,
    simd: str | None = None,
) -> None:
    """Rows of ``codes`` ([rows, code columns]) decoded with their ``scales`` ([rows, blocks]) into ``out``
    ([rows, >= n], fp32/bf16/fp16 or any float dtype on the torch path), columns [0, n): code * scale in
    fp32, then rounded to ``out``'s dtype."""
    _check_format(bits, block)
    if out.dim() != 2 or out.shape[0] != codes.shape[0] or out.shape[1] < n:
        raise ValueError(f"out must be [{codes.shape[0]}, >= {n}], got {tuple(out.shape)}")
    kernel = _kernel(codes, scales, out) if out.dtype in _TYPE_CODES else None
    if kernel is None:
        out[:, :n].copy_(_torch_decode(codes, scales, n, bits, block))
    elif codes.shape[0] and n:
        kernel.dequantize(
            codes.data_ptr(),
            scales.data_ptr(),
            out.data_ptr(),
            _TYPE_CODES[out.dtype],
            out.stride(0),
            False,
            *_layout(codes, scales, n, bits, block),
            torch.get_num_threads(),
            _simd_code(simd),
        )


@torch.no_grad()
def dequantize_sum(
    codes: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    out: torch.Tensor,
    bits: int = 8,
    block: int = BLOCK,
    simd: str | None = None,
) -> torch.Tensor:
    """The decoded rows of ``codes`` / ``scales`` (as in ``dequantize_blocks``) summed into ``out`` ([n]):
    in fp32, in row order (the first row is the starting value, so the sum does not depend on the thread
    count or the path), then rounded to ``out``'s dtype. Returns ``out``."""
    _check_format(bits, block)
    rows = codes.shape[0]
    if rows == 0:
        raise ValueError("dequantize_sum needs at least one row")
    if out.shape != (n,):
        raise ValueError(f"out must be [{n}], got {tuple(out.shape)}")
    out2 = out.view(1, -1)
    kernel = _kernel(codes, scales, out2) if out.dtype in _TYPE_CODES else None
    if kernel is None:
        decoded = _torch_decode(codes, scales, n, bits, block)  # [rows, n] fp32
        if decoded.device.type == "cpu":  # the kernel's order, so a failed build changes no bits
            total = decoded[0]
            for row in decoded[1:]:
                total.add_(row)
        else:  # one reduction kernel on a device
            total = decoded.sum(dim=0)
        out.copy_(total)
    elif n:
        kernel.dequantize(
            codes.data_ptr(),
            scales.data_ptr(),
            out.data_ptr(),
            _TYPE_CODES[out.dtype],
            n,
            True,
            *_layout(codes, scales, n, bits, block),
            torch.get_num_threads(),
            _simd_code(simd),
        )
    return out


def _layout(
    codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block: int
) -> tuple[int, ...]:
    """The kernel's layout arguments (rows, n, block, bits, code stride, scale stride), checked against the
    tensors so that a wrong shape is an error here, not a read past a buffer."""
    ncodes, blocks = code_columns(n, bits, block)
    want = torch.int8 if bits == 8 else torch.uint8
    if codes.dtype != want or scales.dtype != torch.float32:
        raise TypeError(
            f"codes must be {want} and scales float32, got {codes.dtype} and {scales.dtype}"
        )
    if codes.shape[1] < ncodes or scales.shape[1] < blocks or scales.shape[0] != codes.shape[0]:
        raise ValueError(
            f"{n} values need [rows, {ncodes}] codes and [rows, {blocks}] scales, got "
            f"{tuple(codes.shape)} and {tuple(scales.shape)}"
        )
    return codes.shape[0], n, block, bits, codes.stride(0), scales.stride(0)


def _torch_quantize(
    x: torch.Tensor, bits: int, block: int, codes: torch.Tensor, scales: torch.Tensor
) -> None:
    """The torch path of ``quantize_blocks`` (the kernel's reference): one fp32 operation per step."""
    rows, n = x.shape
    blocks = scales.shape[1]
    padded = torch.zeros(
        rows, blocks * block, dtype=torch.float32, device=x.device
    )  # [rows, blocks * block]
    padded[:, :n].copy_(x)
    view = padded.view(rows, blocks, block)
    qmax = _QMAX[bits]
    scale = (
        view.abs().amax(dim=2).div_(qmax)
    )  # [rows, blocks]; a NaN or inf anywhere in a block stays in it
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (
        view.div_(safe.unsqueeze(2)).round_().clamp_(-qmax, qmax)
    )  # [rows, blocks, block], integral floats
    scales.copy_(scale)
    if bits == 8:
        codes.copy_(q.view(rows, -1))
    else:  # low nibble: even element, high nibble: odd element, each + 8; exact in fp32
        pairs = q.view(rows, -1, 2).add_(8.0)
        codes.copy_(pairs[..., 1].mul(16.0).add_(pairs[..., 0]))


def _torch_decode(
    codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block: int
) -> torch.Tensor:
    """Columns [0, n) of the decoded rows, fp32 ``[rows, n]`` (the torch path of the decoders)."""
    rows = codes.shape[0]
    ncodes, blocks = code_columns(n, bits, block)
    _layout(codes, scales, n, bits, block)
    codes, scales = codes[:, :ncodes], scales[:, :blocks]
    if bits == 8:
        values = codes.to(torch.float32)
    else:
        values = (
            torch.stack((codes & 15, codes >> 4), dim=2).view(rows, -1).to(torch.float32).sub_(8.0)
        )
    values = values.view(rows, blocks, block).mul_(scales.unsqueeze(2))  # [rows, blocks, block]
    return values.view(rows, -1)[:, :n]
