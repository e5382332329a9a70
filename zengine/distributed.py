"""Process-group set-up and this process's placement (rank, device)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

# Environment variables of other launchers, mapped onto torchrun's names.
_LAUNCHER_ENV = {
    "OMPI_COMM_WORLD_RANK": "RANK", "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    "SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK",
}


@dataclass(frozen=True)
class Placement:
    """Where this process sits: global rank, local rank, world size and device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @classmethod
    def current(cls) -> "Placement":
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return cls(rank, local, world, device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(dist_backend: Optional[str] = None, timeout: Optional[timedelta] = None) -> None:
    """Initialise torch.distributed from the environment if it is not yet.

    Reads torchrun/elastic variables, else SLURM or OpenMPI ones; a single
    process with none of them runs as world size 1. The backend is NCCL when
    CUDA is available and gloo otherwise, unless ``dist_backend`` names one.
    """
    if dist.is_initialized():
        return
    for src, dst in _LAUNCHER_ENV.items():
        if src in os.environ and dst not in os.environ:
            os.environ[dst] = os.environ[src]
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("LOCAL_RANK", "0")
    if "MASTER_ADDR" not in os.environ:
        if int(os.environ["WORLD_SIZE"]) > 1:
            raise RuntimeError(
                "zengine.init_distributed: WORLD_SIZE > 1 but MASTER_ADDR is not set; "
                "launch with `zengine` or torchrun, or export MASTER_ADDR and MASTER_PORT")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(_free_port()) if os.environ["WORLD_SIZE"] == "1" else "29500")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend=backend, **kwargs)
