"""``zengine.accelerator.get_accelerator()`` (``zengine/device/``): DeepSpeed's members, on the CPU
(CUDA ones skip without a GPU)."""

import pytest
import torch

from zengine.device import current as acc_mod  # where the chosen accelerator is kept
from zengine.accelerator import CpuAccelerator, CudaAccelerator, get_accelerator


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(acc_mod, "_accelerator", None)


def test_cpu_training_gets_the_cpu_accelerator(monkeypatch):
    monkeypatch.setenv("ZENGINE_DEVICE", "cpu")  # what tests/conftest.py sets for the CPU suite
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator) and get_accelerator() is acc
    assert (
        acc.device_name() == "cpu"
        and acc.device_name(1) == "cpu"
        and acc.current_device_name() == "cpu"
    )
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()
    x = torch.ones(3, device=acc.device_name(0))
    assert acc.on_accelerator(x) and acc.pin_memory(x) is x


def test_cpu_memory_figures_are_the_resident_set():
    acc = CpuAccelerator()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert acc.memory_allocated() - before >= 60 * 2**20
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    del block
    assert acc.total_memory() > acc.available_memory() > 0


def test_cpu_streams_and_events_time_and_order_nothing():
    acc = CpuAccelerator()
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    start.record()
    with acc.stream(acc.Stream()):
        torch.ones(10).sum()
    end.record()
    end.synchronize()
    acc.synchronize()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    acc.current_stream().wait_stream(acc.Stream())


def test_seeds_reach_torch():
    acc = CpuAccelerator()
    acc.manual_seed_all(7)
    a = torch.rand(3)
    acc.manual_seed(7)
    assert torch.equal(a, torch.rand(3))
    state = acc.get_rng_state()
    b = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))


def test_ds_accelerator_forces_a_choice(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert isinstance(get_accelerator(), CpuAccelerator)
    acc_mod._accelerator = None
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='tpu'"):
        get_accelerator()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_accelerator(monkeypatch):
    monkeypatch.setenv("ZENGINE_DEVICE", "cuda")
    acc = get_accelerator()
    assert isinstance(acc, CudaAccelerator) and acc.device_name(0) == "cuda:0"
    assert acc.communication_backend_name() == "nccl"
    acc.reset_peak_memory_stats()
    x = torch.ones(2**20, device=acc.current_device_name())
    assert acc.max_memory_allocated() >= x.numel() * 4
    e = acc.Event(enable_timing=True)
    e.record()
    acc.synchronize()
