"""flatten / unflatten_into: round trips through the threaded kernel and the torch path."""

from __future__ import annotations

import pytest
import torch

from zengine.ops import flatten, load_op, unflatten_into


def tensor_list(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (0,), (1,), (1000, 700), (7,), (2, 3, 4), (0, 3), (123457,)]
    return [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_round_trip(dtype, threads):
    tensors = tensor_list(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flat = flatten(tensors)
        assert flat.dtype == dtype and flat.numel() == sum(t.numel() for t in tensors)
        assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
        copies = [torch.empty_like(t) for t in tensors]
        unflatten_into(flat, copies)
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(copies, tensors):
        assert torch.equal(a, b)


def test_padded_buffers_and_kernel_in_use():
    assert load_op("flatten") is not None or pytest.skip("the flatten kernel cannot be built here")
    tensors = tensor_list()
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 5,), -1.0)
    assert flatten(tensors, out=out) is out
    assert torch.equal(out[total:], torch.full((5,), -1.0))  # padding untouched
    copies = [torch.zeros_like(t) for t in tensors]
    unflatten_into(out, copies)
    assert all(torch.equal(a, b) for a, b in zip(copies, tensors))


def test_non_contiguous_tensors_take_the_torch_path():
    strided = torch.arange(12.0).reshape(3, 4).t()  # 4x3, not contiguous
    flat = flatten([strided, torch.arange(3.0)])
    assert torch.equal(flat, torch.cat([strided.reshape(-1), torch.arange(3.0)]))
    target, tail = torch.zeros(3, 4).t(), torch.empty(3)  # a strided destination
    unflatten_into(flat, [target, tail])
    assert torch.equal(target, strided) and torch.equal(tail, torch.arange(3.0))


def test_errors():
    with pytest.raises(ValueError, match="at least"):
        flatten([torch.ones(4)], out=torch.empty(3))
    with pytest.raises(TypeError, match="float64"):
        flatten([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match="at least"):
        unflatten_into(torch.ones(3), [torch.empty(4)])
    assert flatten([]).numel() == 0
