"""Process-group set-up and this process's placement (rank, device).

The compute device is decided once, here, from the process group's backend
(``resolve_device``): NCCL computes on ``cuda:LOCAL_RANK``; gloo on the CPU
unless the caller asks otherwise with ``ZENGINE_DEVICE`` (``cpu``, ``cuda``
or ``cuda:N``). Nothing else in the engine looks at whether CUDA happens to
be visible: every tensor the engine makes is made on ``ProcessPlacement.device`` or,
for host-side work (offload, swap, checkpoints), on the CPU by design.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .shutdown import created_process_group

# Environment variables of other launchers, mapped onto torchrun's names.
_LAUNCHER_ENV = {
    "OMPI_COMM_WORLD_RANK": "RANK", "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    "SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK",
}


DEVICE_ENV = "ZENGINE_DEVICE"
# The device types each backend's collectives take. torch's "fake" backend (no communication at all)
# stands in for NCCL in the CPU guard tests (tests/test_device_guard.py), where the compute device is
# "meta": a device that is not the host, as a GPU is not, on which every host read raises.
BACKEND_DEVICE_TYPES = {"nccl": ("cuda",), "gloo": ("cpu", "cuda"), "fake": ("cuda", "meta"), "xccl": ("xpu",)}


def backend_device_types(backend: Optional[str]) -> Optional[tuple[str, ...]]:
    """The device types a backend communicates, or None when unknown. A per-device backend string
    (``"cpu:gloo,cuda:nccl"``) takes each device type it names."""
    if not backend:
        return None
    if ":" in backend:
        return tuple(pair.split(":", 1)[0].strip() for pair in backend.split(",") if ":" in pair)
    return BACKEND_DEVICE_TYPES.get(backend)


def _default_device_type(backend: Optional[str]) -> str:
    """The compute device a backend means when nothing is requested: its accelerator, else the CPU."""
    types = backend_device_types(backend) or ("cpu",)
    if "cpu" in types and backend in ("gloo", "mpi"):
        return "cpu"  # gloo (and MPI) can drive CUDA tensors, but choosing them is the caller's (ZENGINE_DEVICE)
    accelerators = [t for t in types if t not in ("cpu", "meta")]
    return accelerators[0] if accelerators else "cpu"


def resolve_device(backend: Optional[str], local_rank: int, requested: Optional[str] = None) -> torch.device:
    """The compute device for a rank: ``requested`` (else ``$ZENGINE_DEVICE``) when given, else from the
    backend (NCCL, or a per-device backend naming an accelerator: that accelerator's device
    ``local_rank``; gloo and unknown backends: CPU). Refuses a device the backend cannot communicate on,
    or a CUDA device that is not there, naming what to change."""
    requested = requested or os.environ.get(DEVICE_ENV) or None
    if requested is None:
        kind = _default_device_type(backend)
        device = torch.device("cpu") if kind == "cpu" else torch.device(kind, local_rank)
    else:
        device = torch.device(requested)
        if device.type not in ("cpu", "meta") and device.index is None:
            device = torch.device(device.type, local_rank)
    allowed = backend_device_types(backend)
    if allowed is not None and device.type not in allowed:
        raise RuntimeError(f"zengine: the {backend} backend cannot communicate {device.type} tensors "
                           f"({DEVICE_ENV}={requested!r}); use gloo for CPU training (init_distributed('gloo'))")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= count:
            raise RuntimeError(f"zengine: this rank would compute on {device} but {count} CUDA device(s) are "
                               f"visible; start at most {count} process(es) per node (--num_gpus {count}), or "
                               f"train on the CPU with gloo ({DEVICE_ENV}=cpu)")
    return device


@dataclass(frozen=True)
class ProcessPlacement:
    """Where this process sits: global rank, local rank, world size and compute device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @classmethod
    def current(cls, device: Optional[str] = None) -> "ProcessPlacement":
        """This process's placement in the default process group (world size 1 without one); the device
        from ``resolve_device`` unless ``device`` names one."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        local = int(os.environ.get("LOCAL_RANK", "0"))
        backend = dist.get_backend() if dist.is_initialized() else None
        return cls(rank, local, world, resolve_device(backend, local, device))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEFAULT_PORT = 29500  # DeepSpeed's default distributed_port


def _attempt_store(timeout: Optional[timedelta]):
    """The store the ranks meet through, seen under a prefix of the elastic restart attempt.

    torch's elastic agent keeps one store across restarts (static and c10d rendezvous alike here), so
    the ranks of a restart would otherwise read the addresses the killed attempt's ranks published and
    fail to connect to them ("Gloo connectFullMesh failed ... Connection refused") or wait forever.
    """
    from torch.distributed.rendezvous import _create_c10d_store

    store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                               int(os.environ["WORLD_SIZE"]), timeout or timedelta(minutes=30))
    return dist.PrefixStore(f"zengine/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True, timeout: Optional[timedelta] = None,
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None, config=None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Initialise torch.distributed from the environment if it is not yet (DeepSpeed's parameters).

    Reads torchrun/elastic variables, else SLURM or OpenMPI ones (whatever
    ``auto_mpi_discovery`` says); a single process with none of them runs as
    world size 1. The backend is NCCL when CUDA is available and gloo
    otherwise, unless ``dist_backend`` names one (or ``ZENGINE_DEVICE=cpu``
    asks for CPU training, which means gloo). ``timeout`` bounds every
    collective (the config's ``comm_timeout``); ``distributed_port`` is the
    port when ``MASTER_PORT`` is not set; ``rank``/``world_size`` (when >= 0)
    stand in for ``RANK``/``WORLD_SIZE``; ``init_method`` goes to torch;
    ``dist_init_required=False`` starts nothing. ``verbose`` and ``config``
    are accepted for DeepSpeed's sake and change nothing.
    """
    if dist_init_required is False or dist.is_initialized():
        return
    if rank >= 0:
        os.environ["RANK"] = str(rank)
    if world_size >= 0:
        os.environ["WORLD_SIZE"] = str(world_size)
    for src, dst in _LAUNCHER_ENV.items():
        if src in os.environ and dst not in os.environ:
            os.environ[dst] = os.environ[src]
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if "MASTER_ADDR" not in os.environ:
        if int(os.environ["WORLD_SIZE"]) > 1:
            raise RuntimeError(
                "zengine.init_distributed: WORLD_SIZE > 1 but MASTER_ADDR is not set; "
                "launch with `zengine` or torchrun, or export MASTER_ADDR and MASTER_PORT")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", str(_free_port()) if os.environ["WORLD_SIZE"] == "1" else str(distributed_port))
    wants_cpu = os.environ.get(DEVICE_ENV, "").startswith("cpu")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() and not wants_cpu else "gloo")
    if backend == "nccl":
        device = resolve_device(backend, int(os.environ["LOCAL_RANK"]))  # a clear error when there is no such GPU
        torch.cuda.set_device(device)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if init_method is not None:  # tcp:// and file:// need rank and world size given
        kwargs.update(init_method=init_method, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
        kwargs.update(store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend=backend, **kwargs)
    created_process_group()  # and so destroyed at exit (shutdown.py)
