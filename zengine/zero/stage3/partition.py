"""Stage 3's first cut: a model's parameters become this rank's shards, one parameter at a time.

Used where parameters are first partitioned: ``zero.Init`` as each module is built, and
``zero/place.py`` for a model built elsewhere and handed to ``initialize``. Each parameter is moved,
broadcast from rank 0, cut and released in turn, so the device holds the shards and at most one
whole parameter, never the whole model: a model that fits the device only sharded can be built on
the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...distributed import collectives
from .param import ShardedParam, lookup, register

if TYPE_CHECKING:
    from ..optimizer import ShardGroup


def partition(
    named: list,
    device: torch.device,
    dtype: Optional[torch.dtype],
    world: int,
    rank: int,
    swap=None,
) -> list[ShardedParam]:
    """Cut each (name, parameter) not yet partitioned into this rank's shard, one at a time: moved
    to ``device`` (and ``dtype`` when given), broadcast from rank 0, cut, and released, so the
    device holds the shards and at most one whole parameter. With ``swap`` (NVMe) the shard goes to
    the swap file."""
    made = []
    for name, p in named:
        if p is None or lookup(p) is not None:
            continue
        with torch.no_grad():
            floating = p.is_floating_point()
            if p.device != device or (dtype is not None and floating and p.dtype != dtype):
                p.data = p.data.to(device=device, dtype=dtype if floating else None)
            # every rank (MiCS: every shard group too)
            if dist.is_initialized() and dist.get_world_size() > 1:
                collectives.broadcast(p.data, 0)
        sp = ShardedParam(name, p, world, rank)
        register(sp)
        if swap is not None:
            swap.add(sp)  # to the NVMe swap file, in the compute dtype
        else:
            sp.attach_shard(torch.empty(sp.chunk, dtype=p.dtype, device=p.device))  # [chunk]
        sp.free()
        made.append(sp)
    return made


def partition_model(
    model: nn.Module, dtype: torch.dtype, ranks: "ShardGroup"
) -> list[ShardedParam]:
    """Cut ``model``'s parameters not yet partitioned (by ``zero.Init``) over the shard group
    ``ranks`` (MiCS: this rank's shard group), in the compute ``dtype`` on its device."""
    return partition(list(model.named_parameters()), ranks.device, dtype, ranks.world, ranks.rank)
