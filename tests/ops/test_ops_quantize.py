"""The quantize op (ZeRO++'s blockwise int8/int4 codec): kernel against the torch fallback, bit for bit."""

from __future__ import annotations

import pytest
import torch

from zengine.ops import dequantize_blocks, dequantize_sum, load_op, quantize_blocks, simd_paths
from zengine.ops import quantize as qmod
from zengine.ops.builder import OpBuilder, OpState
from zengine.ops.ops import QUANTIZE

BLOCK = qmod.BLOCK
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernel():
    module = load_op("quantize")
    if module is None:
        pytest.skip("the quantize kernel cannot be built here (see the warning)")
    return module


def rows_of(n: int, dtype: torch.dtype, rows: int = 3, seed: int = 0) -> torch.Tensor:
    """Values over seven decades, an all-zero block, exact ties at half a step, negatives."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen) * torch.logspace(-3, 4, n)
    x[:, : min(n, BLOCK)] = 0.0
    if n > BLOCK + 4:  # with a max of 127 (int8) the step is 1: these are ties, rounded to even
        x[:, BLOCK : BLOCK + 5] = torch.tensor([127.0, 0.5, -2.5, 1.5, -0.5])
    return x.to(dtype)


def torch_codec(x: torch.Tensor, bits: int):
    """The fallback's codes and scales (the kernel is not consulted)."""
    ncodes, blocks = qmod.code_columns(x.shape[1], bits)
    codes = torch.empty(x.shape[0], ncodes, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(x.shape[0], blocks)
    qmod._torch_quantize(x, bits, BLOCK, codes, scales)
    return codes, scales


def use_fallback(monkeypatch):
    monkeypatch.setattr(
        qmod, "load_op", lambda name: None
    )  # as when the build failed or is disabled


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_the_fallback(kernel, path, bits, dtype):
    if path not in simd_paths():
        pytest.skip(f"this CPU cannot run the {path} path")
    for n in (
        1,
        7,
        BLOCK - 1,
        BLOCK + 9,
        3 * BLOCK + 17,
        70001,
    ):  # none a multiple of a vector or a block
        x = rows_of(n, dtype)
        codes, scales = quantize_blocks(x, bits, simd=path)
        want_codes, want_scales = torch_codec(x, bits)
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales), (n, path)
        decoded = qmod._torch_decode(codes, scales, n, bits, BLOCK)  # [3, n] fp32
        for out_dtype in DTYPES:
            out = torch.full((3, n + 3), 9.0, dtype=out_dtype)  # wider rows: the tail stays
            dequantize_blocks(codes, scales, n, out, bits, simd=path)
            assert torch.equal(out[:, :n], decoded.to(out_dtype)) and torch.all(out[:, n:] == 9.0)
            total = dequantize_sum(
                codes, scales, n, torch.empty(n, dtype=out_dtype), bits, simd=path
            )
            assert torch.equal(total, (decoded[0] + decoded[1] + decoded[2]).to(out_dtype))


def test_rounding_ties_to_even_and_zero_blocks(kernel):
    x = rows_of(3 * BLOCK, torch.float32, rows=1)
    codes, scales = quantize_blocks(x, 8)
    assert scales[0, 0] == 0 and torch.all(
        codes[0, :BLOCK] == 0
    )  # an all-zero block: scale 0, codes 0
    assert scales[0, 1] == 1.0  # 127 / 127
    assert codes[0, BLOCK : BLOCK + 5].tolist() == [127, 0, -2, 2, 0]


def test_strided_rows_threads_and_inplace_outputs(kernel):
    wide = rows_of(5000, torch.bfloat16, rows=4)
    x = wide[:, 100:4100]  # rows 5000 apart: the kernel reads them in place
    want_codes, want_scales = torch_codec(x.contiguous(), 4)
    decoded = qmod._torch_decode(want_codes, want_scales, 4000, 4, BLOCK)
    want_sum = decoded[0] + decoded[1] + decoded[2] + decoded[3]  # in row order
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            codes, scales = torch.empty(4, 2048, dtype=torch.uint8), torch.empty(4, 16)
            got = quantize_blocks(x, 4, codes=codes, scales=scales)
            assert got[0].data_ptr() == codes.data_ptr() and got[1].data_ptr() == scales.data_ptr()
            assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
            assert torch.equal(dequantize_sum(codes, scales, 4000, torch.empty(4000), 4), want_sum)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_at_most_half_a_step(bits):
    x = rows_of(3 * BLOCK + 17, torch.float32, rows=2, seed=1)
    codes, scales = quantize_blocks(x, bits)
    if bits == 4:
        assert codes.dtype == torch.uint8 and codes.shape == (2, 2 * BLOCK)  # two codes a byte
    out = torch.empty_like(x)
    dequantize_blocks(codes, scales, x.shape[1], out, bits)
    qmax = 127 if bits == 8 else 7
    padded = torch.nn.functional.pad(x, (0, 4 * BLOCK - x.shape[1])).view(2, 4, BLOCK)
    half_step = (padded.abs().amax(2) / (2 * qmax)).repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]
    err = (out - x).abs()
    assert torch.all(err <= half_step * (1 + 1e-5)), (err - half_step).max()
    assert err.max() > 0 and torch.all(out[:, :BLOCK] == 0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_value_spoils_only_its_block(monkeypatch, bad):
    x = rows_of(3 * BLOCK, torch.float32, rows=1, seed=2)
    x[0, BLOCK + 3] = bad
    results = []
    for fallback in (False, True):
        if fallback:
            use_fallback(monkeypatch)
        codes, scales = quantize_blocks(x, 4)
        out = torch.empty_like(x)
        dequantize_blocks(codes, scales, x.shape[1], out, 4)
        assert not torch.isfinite(out[0, BLOCK : 2 * BLOCK]).any()
        results.append(out[0, 2 * BLOCK :])
    assert torch.isfinite(results[0]).all() and torch.equal(results[0], results[1])


def test_meta_and_device_tensors_take_the_torch_path(monkeypatch):
    def refuse(name):
        raise AssertionError("the kernel was asked for a tensor it cannot take")

    monkeypatch.setattr(qmod, "load_op", refuse)
    codes, scales = quantize_blocks(torch.empty(2, 1000, device="meta", dtype=torch.bfloat16), 4)
    assert codes.device.type == "meta" and codes.shape == (2, 512) and codes.dtype == torch.uint8
    assert scales.shape == (2, 4) and scales.dtype == torch.float32
    out = torch.empty(1000, device="meta")
    assert dequantize_sum(codes, scales, 1000, out, 4).device.type == "meta"
    x = torch.randn(
        2, 300, dtype=torch.float64
    )  # a dtype the kernel does not take: torch on the CPU
    out64 = torch.empty_like(x)
    dequantize_blocks(*quantize_blocks(x), 300, out64)
    assert (out64 - x).abs().max() <= x.abs().max() / 254 * (1 + 1e-5)


def test_a_disabled_build_falls_back_to_the_same_bits(kernel, monkeypatch):
    monkeypatch.setenv("ZENGINE_DISABLE_OPS", "quantize")
    assert OpBuilder(QUANTIZE).status().state is OpState.DISABLED
    x = rows_of(1000, torch.float16, rows=2, seed=3)
    kernel_result = [quantize_blocks(x, bits) for bits in (8, 4)]
    use_fallback(monkeypatch)
    for bits, (codes, scales) in zip((8, 4), kernel_result):
        want_codes, want_scales = quantize_blocks(x, bits)
        assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
        assert torch.equal(
            dequantize_sum(codes, scales, 1000, torch.empty(1000, dtype=torch.bfloat16), bits),
            dequantize_sum(
                want_codes, want_scales, 1000, torch.empty(1000, dtype=torch.bfloat16), bits
            ),
        )


def test_errors():
    with pytest.raises(ValueError, match="bits"):
        quantize_blocks(torch.ones(8), bits=3)
    with pytest.raises(ValueError, match="even"):
        quantize_blocks(torch.ones(8), bits=4, block=7)
    with pytest.raises(TypeError, match="uint8"):
        quantize_blocks(torch.ones(8), bits=4, codes=torch.empty(BLOCK // 2, dtype=torch.int8))
    codes, scales = quantize_blocks(torch.ones(2, 300))
    with pytest.raises(ValueError, match="need"):
        dequantize_blocks(codes[:, :BLOCK], scales, 300, torch.empty(2, 300))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_blocks(
            codes, scales, 300, torch.empty(1, 300)
        )  # a row short: never written past
    with pytest.raises(ValueError, match="at least one row"):
        dequantize_sum(codes[:0], scales[:0], 300, torch.empty(300))
