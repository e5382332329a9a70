"""Stage 3's gather through shared memory (``distributed/shm.py``), straight from the shards into
the parameters.

Through gloo a unit's gather copies this rank's chunks into its row of a staging buffer, moves the
rows, and copies each parameter's columns out of the staging buffer into its storage. Where the
ranks share a host and the transport is installed, the staging buffer is the shared segment itself:
this rank's chunks are copied into its row of each piece, and once every rank has written (the
piece's sync) each parameter's columns are copied out of the piece, every rank's row at once, into
its storage (``SharedMemoryTransport.gather_columns``): two copies of the data in all, and no
transfer at all. The unit's tag (the fetch check's) rides at the end of the row as with gloo.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...distributed import shm, traffic
from ...distributed.shm import SharedMemoryTransport
from .fetch_check import FetchCheck, gather_failed
from .gather import InFlightGather
from .param import ShardedParam


def transport(
    group, params: list[ShardedParam], device: torch.device
) -> Optional[SharedMemoryTransport]:
    """``group``'s shared-memory transport when it has one and every shard of ``params`` is resident
    on this (CPU) device, which ``gather`` reads; else None (the gather goes through the group's
    backend)."""
    found = shm.for_group(group)
    resident = all(sp.shard is not None and sp.shard.device == device for sp in params)
    if found is None or device.type != "cpu" or not resident:
        return None
    return found


def gather(
    transport: SharedMemoryTransport, params: list[ShardedParam], tag: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """Make ``params`` whole through ``transport``; every rank calls this with the same parameters.
    Returns the gathered tag columns ([world, len(tag)]) when ``tag`` is given (the caller compares
    them)."""
    dtype = params[0].full.dtype
    # this rank's row, in pieces
    sources = [sp.shard.view(-1) for sp in params] + ([tag] if tag is not None else [])
    # [world, tag]
    tags = torch.empty(transport.world, tag.numel(), dtype=dtype) if tag is not None else None
    # each [world, width]
    targets = [sp.allocate() for sp in params] + ([tags] if tag is not None else [])
    width = sum(t.shape[1] for t in targets)
    traffic.record(
        "all_gather", transport.world * width * params[0].full.element_size(), transport.group
    )
    transport.gather_columns(sources, targets, dtype)
    return tags


def start(
    transport: SharedMemoryTransport,
    params: list[ShardedParam],
    tag: Optional[torch.Tensor],
    check: FetchCheck,
) -> InFlightGather:
    """Gather ``params`` through ``transport``, done before this returns (``check`` compares the
    tags); the gather it returns has nothing left to wait for or copy out."""
    try:
        tags = gather(transport, params, tag)
    except shm.CollectiveMismatchError as e:  # named as the backend's refusal is (gather.py)
        raise gather_failed(params, transport.rank, check.issued_count, e) from e
    if tags is not None:
        check.compare(tags, tag)
    return InFlightGather(params, None, [], [sp.chunk for sp in params], direct=True)
