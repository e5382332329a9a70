"""Stage 3's gather through shared memory (``distributed/shm.py``), straight from the shards into the parameters.

Through gloo a unit's gather copies this rank's chunks into its row of a staging buffer, moves the rows,
and copies each parameter's columns out of the staging buffer into its storage. Where the ranks share a
host and the transport is installed, the staging buffer is the shared segment itself: this rank's chunks
are copied into its row of each piece, and once every rank has written (the piece's sync) each parameter's
columns are copied out of the piece, every rank's row at once, into its storage: two copies of the data in
all, and no transfer at all. The unit's tag (the fetch check's) rides at the end of the row as with gloo.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...distributed import shm, traffic
from ...distributed.shm import SharedMemoryTransport
from .param import ShardedParam


def transport(group, params: list[ShardedParam], device: torch.device) -> Optional[SharedMemoryTransport]:
    """``group``'s shared-memory transport when it has one and every shard of ``params`` is resident on this
    (CPU) device, which ``gather`` reads; else None (the gather goes through the group's backend)."""
    found = shm.for_group(group)
    if found is None or device.type != "cpu" or not all(sp.shard is not None and sp.shard.device == device
                                                         for sp in params):
        return None
    return found


def gather(transport: SharedMemoryTransport, params: list[ShardedParam], rank: int,
           tag: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Make ``params`` whole through ``transport``; every rank calls this with the same parameters. Returns the
    gathered tag columns ([world, len(tag)]) when ``tag`` is given (the caller compares them)."""
    dtype = params[0].full.dtype
    sources = [sp.shard.view(-1) for sp in params] + ([tag] if tag is not None else [])  # this rank's row, in pieces
    world = transport.world
    tags = torch.empty(world, tag.numel(), dtype=dtype) if tag is not None else None  # [world, tag]
    targets = [sp.allocate() for sp in params] + ([tags] if tag is not None else [])  # each [world, width]
    widths = [t.shape[1] for t in targets]
    traffic.record("all_gather", world * sum(widths) * params[0].full.element_size(), transport.group)
    per = transport.columns(dtype)
    i, offset = 0, 0  # the target being copied and how far into its columns
    while i < len(targets):
        # one piece: the next `per` columns, across the targets they fall on
        spans, width = [], 0
        j, o = i, offset
        while j < len(targets) and width < per:
            take = min(widths[j] - o, per - width)
            spans.append((j, o, take, width))
            width += take
            o += take
            if o == widths[j]:
                j, o = j + 1, 0
        piece = transport.piece(dtype, width)  # [world, width]
        for t, start, take, col in spans:
            piece[rank, col:col + take].copy_(sources[t][start:start + take])
        transport.sync()
        for t, start, take, col in spans:
            targets[t][:, start:start + take].copy_(piece[:, col:col + take])
        i, offset = j, o  # where the next piece starts
    return tags
