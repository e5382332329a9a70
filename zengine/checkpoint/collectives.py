"""The few object collectives a checkpoint needs (a single process needs none)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_gather(obj: Any, group=None) -> list:
    """Every rank's ``obj``, indexed by rank."""
    if _world(group) == 1:
        return [obj]
    out = [None] * _world(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any, group=None) -> Any:
    """The group's first rank's ``obj`` on every rank."""
    if _world(group) == 1:
        return obj
    box = [obj]
    src = 0 if group is None or group is dist.GroupMember.WORLD else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
