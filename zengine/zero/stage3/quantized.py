"""ZeRO++'s quantized communication at stage 3: blockwise int8 parameter gathers (``zero_quantized_weights``,
the codecs below) and gradient reductions (``zero_quantized_gradients``, ``quantized_reduce_scatter``).

A gather's staging buffer is ``[world, n (+ tag)]`` in the compute dtype; each rank fills its own
row. The exact codec (``gather.ExactGather``) all-gathers those rows as they are. ``Int8Gather``
sends each row as int8 values with one fp32 scale per block of ``BLOCK`` elements (scale = the
block's largest magnitude / 127, values rounded to the nearest step): a quarter of fp32's bytes,
half of bf16's, plus 4 bytes per block. After the gather every row, this rank's included, is the
dequantized one, so every rank computes with the same weights. The
error of an element is at most half a step, ``max|block| / 254``. The fetch check's tag columns
travel exactly beside the scales.

The gradient reduction can also send int4 codes (``bits=4``: scale = the block's largest magnitude / 7, two
codes a byte: half of int8's bytes again, error at most ``max|block| / 14``). The codec itself is
``zengine.ops.quantize``: the compiled ``quantize`` op for CPU tensors (SIMD, threads), the same operations
as torch ops elsewhere (device tensors, or where the op cannot be built), bit for bit alike.

Only the gathers that feed compute are quantized: the masters and shards stay exact, and the gathers that
hand parameters to the user (``summon_full_params``, ``GatheredParameters``, the re-gather after a step of
parameters that stay whole) are exact.
"""

from __future__ import annotations

import torch

from ...distributed import collectives
from ...ops.quantize import dequantize_blocks, dequantize_sum, quantize_blocks
from .gather import EXACT, GatherCodec

BLOCK = 256  # elements per scale (DeepSpeed's ZeRO++ quantizes in groups too; smaller: finer, more scales)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([n], float) as (int8 [blocks * BLOCK], fp32 scales [blocks]), zero-padded to whole blocks."""
    return quantize_blocks(x, 8, BLOCK)


def dequantize(q: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """Rows of int8 ``q`` ([rows, blocks * BLOCK]) times their ``scales`` ([rows, blocks]) into ``out``
    ([rows, >= n], any float dtype), columns [0, n)."""
    dequantize_blocks(q, scales, n, out, 8, BLOCK)


class Int8Gather:
    """All-gather the staging rows as blockwise int8 with fp32 scales (see the module doc); a
    ``gather.GatherCodec``."""

    finishes = True  # dequantize the received rows (``finish``) once the gather lands
    # a block's scale is its largest magnitude: coalesced with its neighbours a parameter would
    # quantize otherwise (and differently in forward and backward, whose groups differ)
    values_depend_on_row = True

    def start(self, staging: torch.Tensor, ncols: int, rank: int, group) -> tuple[list, object]:
        """Quantize this rank's row and launch the gathers of the codes and of the scales (and tag)."""
        world, width = staging.shape
        blocks = -(-ncols // BLOCK)
        extra = width - ncols  # the fetch check's tag columns: sent exactly, after the scales
        q = torch.empty(
            world, blocks * BLOCK, dtype=torch.int8, device=staging.device
        )  # [world, blocks * BLOCK]
        side = torch.empty(
            world, blocks + extra, dtype=torch.float32, device=staging.device
        )  # [world, blocks + tag]
        quantize_blocks(staging[rank, :ncols], 8, BLOCK, codes=q[rank], scales=side[rank, :blocks])
        if extra:
            side[rank, blocks:].copy_(staging[rank, ncols:])
        works = collectives.all_gather_rows(q, rank, group, async_op=True)
        works += collectives.all_gather_rows(side, rank, group, async_op=True)
        return works, (q, side, blocks)

    def finish(self, staging: torch.Tensor, ncols: int, state) -> None:
        """Dequantize every rank's row into ``staging`` and put the tag columns back."""
        q, side, blocks = state
        dequantize(q, side[:, :blocks], ncols, staging)
        if side.shape[1] > blocks:
            staging[:, ncols:].copy_(side[:, blocks:])


def quantize_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` ([rows, n]) as codes ([rows, blocks * BLOCK] int8, or [rows, blocks * BLOCK / 2]
    uint8 for ``bits`` 4: two codes a byte) and fp32 scales ([rows, blocks])."""
    return quantize_blocks(x, bits, BLOCK)


def quantized_reduce_scatter(buf: torch.Tensor, group, bits: int = 8) -> tuple[list, "callable"]:
    """qgZ: sum ``buf`` ([world, n], row r destined for rank r) over the group, this rank keeping its row's
    sum, with each rank's rows sent as blockwise int8 (``bits`` 8) or int4 (``bits`` 4, as DeepSpeed's qgZ
    sends them: half the bytes again) in an all-to-all and summed in fp32, in rank order, after decoding.
    Returns the works and a function giving the summed row ([n], ``buf``'s dtype) once they are done. The
    error of an element is at most the sum over ranks of half their block's step (``max|block| / 254`` for
    int8, ``max|block| / 14`` for int4)."""
    world, n = buf.shape
    q, scales = quantize_rows(buf, bits)
    got_q, got_scales = torch.empty_like(q), torch.empty_like(scales)
    works = [
        collectives.all_to_all(got_q, q, group, async_op=True),
        collectives.all_to_all(got_scales, scales, group, async_op=True),
    ]

    def summed() -> torch.Tensor:
        out = torch.empty(n, dtype=buf.dtype, device=buf.device)  # [n]: this rank's part, summed
        return dequantize_sum(got_q, got_scales, n, out, bits, BLOCK)

    return works, summed


def gather_codec(zero_cfg) -> GatherCodec:
    """The codec the config asks for (``zero_quantized_weights``)."""
    return Int8Gather() if getattr(zero_cfg, "zero_quantized_weights", False) else EXACT
