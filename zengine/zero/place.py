"""Where the model starts: on the compute device, in the compute dtype, every replica from rank 0's
values; at stage 3 cut as it moves (``stage3/partition.py``). The engine calls ``place_model``
once, before the stage's parts are built on the placed parameters."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..distributed import collectives
from ..precision.cast import cast_module
from .optimizer import ShardGroup


def place_model(
    model: nn.Module,
    stage: int,
    dtype: torch.dtype,
    ranks: ShardGroup,
    buffer_dtype: Optional[torch.dtype] = None,
) -> None:
    """Put the model on the compute device in the compute dtype (floating buffers in
    ``buffer_dtype``, None: the compute dtype), every replica starting from rank 0's values.

    At stage 3 the parameters are cut as they move, one at a time (``partition_model``, what
    ``zero.Init`` does as modules are built): the device holds this rank's shards and at most one
    whole parameter, never the whole model, so a model that fits the device only sharded can be
    built on the host and handed to ``initialize``. At stages 0-2 every rank holds the whole model
    anyway.
    """
    if stage == 3:
        from .stage3.partition import partition_model  # stage 3's parts load only when used

        partition_model(model, dtype, ranks)
    cast_module(
        model, dtype, ranks.device, buffer_dtype
    )  # buffers, and parameters stages 0-2 keep whole
    broadcast_from_rank0(model, ranks.dp_world)


def broadcast_from_rank0(model: nn.Module, world: int) -> None:
    """Start every replica from rank 0's parameters and buffers (ranks may have initialised
    differently).

    Parameters already partitioned (by ``zero.Init`` or ``partition_model``) are skipped: they
    were broadcast before they were cut.
    """
    if world == 1:
        return
    from .stage3.param import lookup

    with torch.no_grad():
        for t in [p for p in model.parameters() if lookup(p) is None] + list(model.buffers()):
            collectives.broadcast(t.data, 0)
