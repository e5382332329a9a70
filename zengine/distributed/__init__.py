"""Process plumbing: the process group and the compute device (``process_group.py``), the thin
collective functions every part calls (``collectives.py``), the one host read per step
(``sync.py``), and what happens when ranks fail or leave (``diagnose.py``, ``shutdown.py``).

Nothing here knows about ZeRO; ``zengine.comm`` is DeepSpeed's public face of it.
"""

from .process_group import (
    BACKEND_DEVICE_TYPES,
    DEFAULT_PORT,
    DEVICE_ENV,
    LOCAL_RANK_VARIABLES,
    ProcessRank,
    backend_device_types,
    gpu_index,
    init_distributed,
    local_rank,
    resolve_device,
)

__all__ = [
    "BACKEND_DEVICE_TYPES",
    "DEFAULT_PORT",
    "DEVICE_ENV",
    "LOCAL_RANK_VARIABLES",
    "ProcessRank",
    "backend_device_types",
    "gpu_index",
    "init_distributed",
    "local_rank",
    "resolve_device",
]
