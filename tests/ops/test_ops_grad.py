"""unscale_and_norm_: the fused unscale + sum of squares + non-finite check against torch."""

from __future__ import annotations

import math

import pytest
import torch

from zengine.ops import load_op, simd_paths, unscale_and_norm_


@pytest.fixture(scope="module")
def kernel():
    module = load_op("unscale_norm")
    if module is None:
        pytest.skip("the unscale_norm kernel cannot be built here (see the warning)")
    return module


def make_grads():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) * 1000 for n in (1, 7, 8, 15, 17, 65536 * 3 + 5, 1000003)]


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("inv_scale", [1.0, 1 / 1024])
def test_matches_torch(kernel, path, inv_scale):
    if path not in simd_paths():
        pytest.skip(f"this CPU cannot run the {path} path")
    grads = make_grads()
    expected = [g * inv_scale for g in grads]
    stats = unscale_and_norm_(grads, inv_scale, simd=path)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)  # unscaled in place, one fp32 multiply per element
    ref = sum(float(e.double().square().sum()) for e in expected)
    assert not stats.found_inf
    assert math.isclose(stats.sum_sq, ref, rel_tol=1e-12)
    assert math.isclose(stats.norm, math.sqrt(ref), rel_tol=1e-12)


def test_thread_count_does_not_change_the_sum(kernel):
    grad = make_grads()[-1]
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = unscale_and_norm_(grad.clone()).sum_sq
        torch.set_num_threads(2)
        two = unscale_and_norm_(grad.clone()).sum_sq
    finally:
        torch.set_num_threads(previous)
    assert one == two


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_is_found(kernel, bad):
    for position in (0, 12345, 1000002):  # vector body, middle, tail
        grad = torch.ones(1000003)
        grad[position] = bad
        stats = unscale_and_norm_([torch.ones(9), grad], 0.5)
        assert stats.found_inf and not math.isfinite(stats.sum_sq)


def test_huge_finite_values_are_not_overflow(kernel):
    grad = torch.full((1000,), 3e38)  # its square overflows fp32, not the float64 sum
    stats = unscale_and_norm_(grad)
    assert not stats.found_inf and math.isclose(stats.sum_sq, 1000 * 3e38**2, rel_tol=1e-6)
    assert unscale_and_norm_(torch.full((4,), 3e38), 2.0).found_inf  # unscaling overflows: inf


def test_other_dtypes_take_the_torch_path():
    grad = torch.tensor([1.0, -2.0, 4.0], dtype=torch.bfloat16)
    stats = unscale_and_norm_(grad, 0.5)
    assert torch.equal(grad, torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16))
    assert stats.sum_sq == 0.25 + 1.0 + 4.0 and not stats.found_inf
    assert unscale_and_norm_(torch.tensor([1.0, float("nan")], dtype=torch.float64)).found_inf
