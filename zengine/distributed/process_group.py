"""Process-group set-up and this process's rank record (rank, local rank, world size, device).

The compute device is decided once, here, from the process group's backend
(``resolve_device``): NCCL computes on this rank's GPU; gloo on the CPU
unless the caller asks otherwise with ``ZENGINE_DEVICE`` (``cpu``, ``cuda``
or ``cuda:N``). Nothing else in the engine looks at whether CUDA happens to
be visible: every tensor the engine makes is made on ``ProcessRank.device`` or,
for host-side work (offload, swap, checkpoints), on the CPU by design.

Which GPU is "this rank's" (torch's and DeepSpeed's rules, with the per-rank visibility that
SLURM and MPI set-ups use):

1. The local rank (``local_rank``) is the first of ``LOCAL_RANK`` (torchrun, the zengine launcher),
   ``OMPI_COMM_WORLD_LOCAL_RANK`` (OpenMPI), ``MV2_COMM_WORLD_LOCAL_RANK`` (MVAPICH),
   ``MPI_LOCALRANKID`` (MPICH, Intel MPI) and ``SLURM_LOCALID`` (srun) that is set. SLURM's comes
   last because an ``sbatch`` shell carries ``SLURM_LOCALID=0`` into every process ``mpirun`` starts.
2. With none of them set and a world of several ranks (a group the script made from ``RANK`` and
   ``WORLD_SIZE`` alone), it is ``rank % visible GPUs``: torch's DeviceMesh heuristic, right when
   each node runs its ranks as one consecutive block of at most that many ranks (mpirun's and
   SLURM's default block placement). DeepSpeed would ask MPI for the host names instead; that needs
   mpi4py, and every MPI launcher that places ranks otherwise sets one of the variables above.
3. The GPU index is the local rank when that many GPUs are visible. When exactly one is visible
   (``CUDA_VISIBLE_DEVICES`` set per rank) it is ``cuda:0`` whatever the local rank. A local rank
   past a visible count above one is refused, naming the variable, the count and
   ``CUDA_VISIBLE_DEVICES``: there is no such GPU, and folding it onto one that exists would put two
   ranks of the node on one GPU, which NCCL refuses ("Duplicate GPU detected") far from the cause.
4. ``ZENGINE_DEVICE=cuda:N`` names the index outright; ``ZENGINE_DEVICE=cuda`` follows rule 3.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .shutdown import created_process_group

# Environment variables of other launchers, mapped onto torchrun's names (OpenMPI's first: an sbatch
# shell's SLURM_PROCID=0 reaches every rank mpirun starts). The local rank has its own lookup (local_rank).
_LAUNCHER_ENV = {
    "OMPI_COMM_WORLD_RANK": "RANK",
    "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "SLURM_PROCID": "RANK",
    "SLURM_NTASKS": "WORLD_SIZE",
}

# Where launchers put a process's rank on its node, in the order they are believed (module doc, rule 1).
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
)


DEVICE_ENV = "ZENGINE_DEVICE"
# The device types each backend's collectives take. torch's "fake" backend (no communication at all)
# stands in for NCCL in the CPU guard tests (tests/test_device_guard.py), where the compute device is
# "meta": a device that is not the host, as a GPU is not, on which every host read raises.
BACKEND_DEVICE_TYPES = {
    "nccl": ("cuda",),
    "gloo": ("cpu", "cuda"),
    "fake": ("cuda", "meta"),
    "xccl": ("xpu",),
}


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


def visible_cuda_devices() -> int:
    """How many CUDA devices this process sees (after ``CUDA_VISIBLE_DEVICES``); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _launcher_local_rank() -> Optional[tuple[str, int]]:
    """The first local-rank variable that is set, as (name, value); None when a launcher set none."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return name, int(value)
    return None


def local_rank(device_count: Callable[[], int] = visible_cuda_devices) -> int:
    """This process's rank on its node (module doc, rules 1 and 2): the first local-rank variable set
    (``LOCAL_RANK``, OpenMPI's, MVAPICH's, MPICH's, SLURM's); with none, in a world of several ranks,
    the global rank modulo ``device_count()`` (when above one); else 0. The global rank and world size
    are the process group's once it exists, ``RANK``/``WORLD_SIZE`` before."""
    found = _launcher_local_rank()
    if found is not None:
        return found[1]
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    count = device_count() if world > 1 else 0
    return rank % count if count > 1 else 0


def world_rank() -> int:
    """This process's rank in the default process group (the world); 0 before one exists."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _visible(count: int) -> str:
    """The visible CUDA device count and where it came from, for messages."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"{count} CUDA device(s) are visible (CUDA_VISIBLE_DEVICES="
        f"{'unset' if listed is None else repr(listed)})"
    )


def gpu_index(local_rank: int, count: int) -> int:
    """The CUDA device index for a rank with this local rank when ``count`` devices are visible (module
    doc, rule 3): the local rank; 0 when one device is visible (a GPU per process). Raises, naming
    the local-rank variable, the count and ``CUDA_VISIBLE_DEVICES``, when there is no such device."""
    if count == 1:
        return 0
    if 0 <= local_rank < count:
        return local_rank
    found = _launcher_local_rank()
    origin = f", {found[0]}={found[1]}" if found is not None and found[1] == local_rank else ""
    where = (
        f"zengine: this rank (local rank {local_rank}{origin}) would compute on cuda:{local_rank} but "
        f"{_visible(count)}"
    )
    if count == 0:
        raise RuntimeError(
            f"{where}; train on the CPU with gloo ({DEVICE_ENV}=cpu), or make a GPU visible"
        )
    raise RuntimeError(
        f"{where}; start at most {count} process(es) per node (--num_gpus {count}), or make one "
        f"GPU visible to each process (CUDA_VISIBLE_DEVICES set per rank; it then computes on "
        f"cuda:0), or name the device ({DEVICE_ENV}=cuda:N)"
    )


def resolve_device(
    backend: Optional[str],
    local_rank: int,
    requested: Optional[str] = None,
    device_count: Callable[[], int] = visible_cuda_devices,
) -> torch.device:
    """The compute device for a rank: ``requested`` (else ``$ZENGINE_DEVICE``) when given, else from the
    backend (NCCL, or a per-device backend naming an accelerator: that accelerator; gloo and unknown
    backends: CPU). A CUDA device without an index is ``gpu_index(local_rank, device_count())``;
    other accelerators take index ``local_rank``. Refuses a device the backend cannot communicate on,
    or a CUDA device that is not there, naming what to change. ``device_count`` counts the visible
    CUDA devices (tests pass their own)."""
    requested = requested or os.environ.get(DEVICE_ENV) or None
    if requested is None:
        kind = _default_device_type(backend)
        device = torch.device("cpu") if kind == "cpu" else torch.device(kind)
    else:
        device = torch.device(requested)
    allowed = backend_device_types(backend)
    if allowed is not None and device.type not in allowed:
        raise RuntimeError(
            f"zengine: the {backend} backend cannot communicate {device.type} tensors "
            f"({DEVICE_ENV}={requested!r}); use gloo for CPU training (init_distributed('gloo'))"
        )
    if device.type == "cuda":
        count = device_count()
        if device.index is None:
            return torch.device("cuda", gpu_index(local_rank, count))
        if (
            device.index >= count
        ):  # asked for by index: taken as given, so only its existence is checked
            raise RuntimeError(
                f"zengine: this rank would compute on {device} (asked for: {requested!r}) but "
                f"{_visible(count)}; ask for a visible index, or for 'cuda' (this rank's GPU), "
                f"or train on the CPU with gloo ({DEVICE_ENV}=cpu)"
            )
    elif device.type not in ("cpu", "meta") and device.index is None:
        device = torch.device(device.type, local_rank)
    return device


@dataclass(frozen=True)
class ProcessRank:
    """This process in the world: its global rank, its rank on its node, the world size, and the
    device it computes on. The ranks the model states are sharded over (all of them, or a MiCS
    shard group) are built from it: ``zero.stages.shard_group``."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @classmethod
    def current(cls, device: Optional[str] = None) -> "ProcessRank":
        """This process's rank record in the default process group (world size 1 without one);
        the device from ``resolve_device`` unless ``device`` names one."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        local = local_rank()
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

    store = _create_c10d_store(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        timeout or timedelta(minutes=30),
    )
    return dist.PrefixStore(f"zengine/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def init_distributed(
    dist_backend: Optional[str] = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: Optional[timedelta] = None,
    init_method: Optional[str] = None,
    dist_init_required: Optional[bool] = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
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
    os.environ.setdefault(
        "LOCAL_RANK", str(local_rank())
    )  # scripts and torch read LOCAL_RANK alone
    if "MASTER_ADDR" not in os.environ:
        if int(os.environ["WORLD_SIZE"]) > 1:
            raise RuntimeError(
                "zengine.init_distributed: WORLD_SIZE > 1 but MASTER_ADDR is not set; "
                "launch with `zengine` or torchrun, or export MASTER_ADDR and MASTER_PORT"
            )
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault(
        "MASTER_PORT",
        str(_free_port()) if os.environ["WORLD_SIZE"] == "1" else str(distributed_port),
    )
    wants_cpu = os.environ.get(DEVICE_ENV, "").startswith("cpu")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() and not wants_cpu else "gloo")
    if backend == "nccl":
        device = resolve_device(backend, local_rank())  # a clear error when there is no such GPU
        torch.cuda.set_device(device)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if init_method is not None:  # tcp:// and file:// need rank and world size given
        kwargs.update(
            init_method=init_method,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
        kwargs.update(
            store=_attempt_store(timeout),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    dist.init_process_group(backend=backend, **kwargs)
    created_process_group()  # and so destroyed at exit (shutdown.py)
