"""The compute device decided from the backend and the local rank (zengine/distributed/process_group.py), on a box
with or without GPUs: the GPU counts are stand-ins, so every placement rule is checked without a GPU or a process."""

import os

import pytest
import torch

import zengine.comm as zcomm
from zengine.accelerator import CpuAccelerator
from zengine.distributed import collectives as comm
from zengine.distributed import process_group
from zengine.distributed.process_group import (
    LOCAL_RANK_VARIABLES,
    backend_device_types,
    local_rank,
    resolve_device,
)


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
    assert resolve_device("cpu:gloo,cuda:nccl", 1) == torch.device(
        "cuda", 1
    )  # the accelerator it names
    assert resolve_device("gloo", 1) == torch.device(
        "cpu"
    )  # a visible GPU does not make gloo use it
    assert resolve_device("mpi", 0) == torch.device("cpu") and resolve_device(
        None, 0
    ) == torch.device("cpu")
    assert resolve_device("gloo", 1, "cuda") == torch.device(
        "cuda", 1
    )  # asked for: the local rank's GPU
    monkeypatch.setenv("ZENGINE_DEVICE", "cuda:0")
    assert resolve_device("gloo", 1) == torch.device("cuda", 0)


def test_impossible_devices_are_refused_by_name(monkeypatch, two_gpus):
    monkeypatch.delenv("ZENGINE_DEVICE", raising=False)
    with pytest.raises(RuntimeError, match="the nccl backend cannot communicate cpu tensors"):
        resolve_device("nccl", 0, "cpu")
    with pytest.raises(
        RuntimeError, match=r"compute on cuda:2 but 2 CUDA device\(s\) are visible.*--num_gpus 2"
    ):
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


# -- which GPU a rank computes on (the module doc's rules) ------------------------------------------------
def visible(n):
    """A stand-in for the visible CUDA device count."""
    return lambda: n


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher variables, no device request: each test sets only what its launcher would. Each name is
    set before it is deleted so that monkeypatch restores it even when the code under test writes it
    (delenv of an absent name records nothing)."""
    for name in (
        *LOCAL_RANK_VARIABLES,
        "RANK",
        "WORLD_SIZE",
        "CUDA_VISIBLE_DEVICES",
        "ZENGINE_DEVICE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
    ):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def placed(count):
    """The device NCCL would compute on in this environment with ``count`` GPUs visible."""
    return resolve_device("nccl", local_rank(visible(count)), device_count=visible(count))


def test_one_gpu_per_process_is_cuda_0_whatever_the_local_rank(bare_env):
    bare_env.setenv("LOCAL_RANK", "3")
    bare_env.setenv(
        "CUDA_VISIBLE_DEVICES", "3"
    )  # SLURM --gpus-per-task=1 / a wrapper script per rank
    assert local_rank(visible(1)) == 3  # the node position stays the launcher's
    assert placed(1) == torch.device("cuda", 0)


def test_openmpi_local_rank(bare_env):
    bare_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    bare_env.setenv(
        "SLURM_LOCALID", "0"
    )  # mpirun inside sbatch: the batch shell's value reaches every rank
    assert placed(2) == torch.device("cuda", 1)
    assert (
        zcomm.get_local_rank() == 1 and CpuAccelerator().current_device() == 1
    )  # one lookup everywhere


def test_slurm_and_mvapich_local_rank(bare_env):
    bare_env.setenv("SLURM_LOCALID", "1")
    assert placed(4) == torch.device("cuda", 1)
    bare_env.setenv("MV2_COMM_WORLD_LOCAL_RANK", "2")  # MVAPICH's is believed before SLURM's
    assert placed(4) == torch.device("cuda", 2)
    bare_env.setenv("LOCAL_RANK", "3")  # torchrun's / the zengine launcher's before any
    assert placed(4) == torch.device("cuda", 3)


def test_local_rank_past_the_visible_gpus_is_refused_by_name(bare_env):
    bare_env.setenv("LOCAL_RANK", "3")
    bare_env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(
        RuntimeError,
        match=r"local rank 3, LOCAL_RANK=3\) would compute on cuda:3 but 2 CUDA "
        r"device\(s\) are visible \(CUDA_VISIBLE_DEVICES='0,1'\).*--num_gpus 2"
        r".*one GPU visible to each process",
    ):
        placed(2)
    bare_env.delenv("LOCAL_RANK")
    bare_env.setenv("SLURM_LOCALID", "2")
    with pytest.raises(RuntimeError, match=r"SLURM_LOCALID=2\) would compute on cuda:2"):
        placed(2)


def test_no_local_rank_variable_spreads_the_ranks_over_the_gpus(bare_env):
    """A script-made group under a launcher that set only RANK/WORLD_SIZE: rank % visible GPUs (torch's
    DeviceMesh heuristic), not cuda:0 for every rank (NCCL's "Duplicate GPU")."""
    bare_env.setenv("RANK", "3")
    bare_env.setenv("WORLD_SIZE", "4")
    assert placed(2) == torch.device("cuda", 1)  # second node, second GPU
    assert placed(4) == torch.device("cuda", 3)
    assert placed(1) == torch.device("cuda", 0)  # one GPU per process
    bare_env.setenv("WORLD_SIZE", "1")
    assert local_rank(visible(4)) == 0


def test_zengine_device_wins(bare_env):
    bare_env.setenv("LOCAL_RANK", "3")
    bare_env.setenv("ZENGINE_DEVICE", "cpu")
    assert resolve_device("gloo", 3, device_count=visible(4)) == torch.device("cpu")
    bare_env.setenv("ZENGINE_DEVICE", "cuda:1")  # an index is taken as given
    assert placed(4) == torch.device("cuda", 1) and placed(2) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"cuda:1 \(asked for: 'cuda:1'\) but 1 CUDA device"):
        placed(1)
    bare_env.setenv("ZENGINE_DEVICE", "cuda")  # no index: this rank's GPU, by the same rules
    assert placed(4) == torch.device("cuda", 3) and placed(1) == torch.device("cuda", 0)


def test_init_distributed_places_an_mpirun_rank(bare_env):
    """mpirun inside sbatch, one GPU made visible per rank: LOCAL_RANK comes from OpenMPI and NCCL's
    device is cuda:0 (was: refused, since cuda:LOCAL_RANK did not exist)."""
    calls = {}
    bare_env.setenv("OMPI_COMM_WORLD_RANK", "3")
    bare_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    bare_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    bare_env.setenv("SLURM_PROCID", "0")
    bare_env.setenv("SLURM_LOCALID", "0")
    bare_env.setenv("CUDA_VISIBLE_DEVICES", "1")
    bare_env.setenv("MASTER_ADDR", "127.0.0.1")
    bare_env.setattr(torch.cuda, "is_available", lambda: True)
    bare_env.setattr(torch.cuda, "device_count", lambda: 1)
    bare_env.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("device", device))
    bare_env.setattr(process_group.dist, "is_initialized", lambda: False)
    bare_env.setattr(
        process_group.dist,
        "init_process_group",
        lambda **kw: calls.setdefault("backend", kw["backend"]),
    )
    bare_env.setattr(process_group, "created_process_group", lambda: None)
    process_group.init_distributed()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "3",
        "4",
        "1",
    )
    assert calls == {"device": torch.device("cuda", 0), "backend": "nccl"}
