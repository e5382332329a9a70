"""The compute device decided from the backend (zengine/distributed/process_group.py), on a box with or without GPUs."""
import pytest
import torch

from zengine.distributed import collectives as comm
from zengine.distributed.process_group import backend_device_types, resolve_device


@pytest.fixture
def two_gpus(monkeypatch):
    """Pretend two CUDA devices are visible (nothing here touches them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_backend_device_types():
    assert backend_device_types("nccl") == ("cuda",)
    assert backend_device_types("gloo") == ("cpu", "cuda")
    assert backend_device_types("cpu:gloo,cuda:nccl") == ("cpu", "cuda")
    assert backend_device_types("mpi") is None and backend_device_types(None) is None


def test_device_follows_the_backend(monkeypatch, two_gpus):
    monkeypatch.delenv("ZENGINE_DEVICE", raising=False)
    assert resolve_device("nccl", 1) == torch.device("cuda", 1)
    assert resolve_device("cpu:gloo,cuda:nccl", 1) == torch.device("cuda", 1)  # the accelerator it names
    assert resolve_device("gloo", 1) == torch.device("cpu")  # a visible GPU does not make gloo use it
    assert resolve_device("mpi", 0) == torch.device("cpu") and resolve_device(None, 0) == torch.device("cpu")
    assert resolve_device("gloo", 1, "cuda") == torch.device("cuda", 1)  # asked for: the local rank's GPU
    monkeypatch.setenv("ZENGINE_DEVICE", "cuda:0")
    assert resolve_device("gloo", 1) == torch.device("cuda", 0)


def test_impossible_devices_are_refused_by_name(monkeypatch, two_gpus):
    monkeypatch.delenv("ZENGINE_DEVICE", raising=False)
    with pytest.raises(RuntimeError, match="the nccl backend cannot communicate cpu tensors"):
        resolve_device("nccl", 0, "cpu")
    with pytest.raises(RuntimeError, match=r"compute on cuda:2 but 2 CUDA device\(s\) are visible.*--num_gpus 2"):
        resolve_device("nccl", 2)


def test_no_gpu_means_a_clear_error_for_nccl(monkeypatch):
    monkeypatch.delenv("ZENGINE_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="0 CUDA device"):
        resolve_device("nccl", 0)


def test_messages_travel_on_the_backends_device(monkeypatch):
    monkeypatch.setattr(comm, "backend", lambda group=None: "gloo")
    assert comm.message_device() == torch.device("cpu")
    monkeypatch.setattr(comm, "backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert comm.message_device() == torch.device("cuda", 1)
