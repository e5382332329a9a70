"""The few object collectives a checkpoint needs (a single process needs none).

Objects travel pickled in uint8 tensors, on the device the group's backend
takes (``collectives.message_device``: the CPU with gloo, the GPU with NCCL). torch's
own ``all_gather_object`` and ``broadcast_object_list`` would need numpy,
which is not a dependency. Only what this job's own ranks pickled is unpickled
here (never a file's bytes: state.pt goes through safe_load.py).
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

from ...distributed import collectives


def _encode(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj)
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8)
    )


def _decode(t: torch.Tensor, n: int) -> Any:
    t = t[:n].contiguous()
    return pickle.loads(ctypes.string_at(t.data_ptr(), n))


def _all_gather_objects(obj: Any, group) -> list:
    mine = _encode(obj)
    device = collectives.message_device(group)
    sizes = (
        collectives.all_gather_small(
            torch.tensor([mine.numel()], dtype=torch.int64).to(device), group
        )
        .view(-1)
        .tolist()
    )
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    out = collectives.all_gather_small(padded.to(device), group).cpu()  # [world, longest] uint8
    return [_decode(t, n) for t, n in zip(out, sizes)]


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_ranks(group=None) -> list[int]:
    """The global ranks of ``group`` in its rank order (all_gather's order)."""
    if not dist.is_initialized():
        return [0]
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def all_gather(obj: Any, group=None) -> list:
    """Every rank's ``obj``, indexed by rank."""
    if _world(group) == 1:
        return [obj]
    return _all_gather_objects(obj, group)


def broadcast(obj: Any, group=None) -> Any:
    """The group's first rank's ``obj`` on every rank."""
    if _world(group) == 1:
        return obj
    rank = dist.get_rank(group)
    return _all_gather_objects(obj if rank == 0 else None, group)[0]
