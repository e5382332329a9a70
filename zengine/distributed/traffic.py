"""What this rank's collectives moved, by kind of collective and kind of group: measured, not claimed.

Every collective function in ``collectives.py`` records here the payload it moved as a whole (the
gathered buffer of an all-gather, the summed buffer of a reduce-scatter or an all-reduce, the broadcast
tensor, the sent buffer of an all-to-all), and the bytes this rank sends over the wire for it on a ring
(``ring_bytes``: (W-1)/W of the payload for an all-gather, a reduce-scatter or an all-to-all, twice that
for an all-reduce), split by whether the group
stays on one node (``intra``) or spans nodes (``inter``). The node of a rank is ``rank //
LOCAL_WORLD_SIZE`` (torchrun and zengine's launcher set it; 4 gloo ranks as 2 "nodes" of 2 set 2).

``engine.comm_stats()`` reads the counters (``zengine.distributed.traffic.snapshot()`` without an engine);
``bench_comm.py`` turns them into bytes per step against the ZeRO formulas.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Optional

import torch.distributed as dist

INTRA, INTER = "intra", "inter"
_RING_FACTOR = {
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_reduce": 2.0,
    "broadcast": 1.0,
    "reduce": 1.0,
    "all_to_all": 1.0,
}

# (group kind, collective) -> [calls, payload bytes, ring bytes sent by this rank]
_counts: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0, 0.0])
_kinds: dict[int, str] = {}  # id(group) -> group kind (a group's ranks never change)


def local_world_size() -> int:
    """Ranks per node: ``LOCAL_WORLD_SIZE``, else every rank on one node."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else (dist.get_world_size() if dist.is_initialized() else 1)


def group_kind(group=None) -> str:
    """``intra`` when every rank of ``group`` is on this rank's node, else ``inter``."""
    key = id(group)
    if key not in _kinds:
        per_node = max(1, local_world_size())
        if group is None or group is dist.GroupMember.WORLD:
            ranks = range(dist.get_world_size())
        else:
            ranks = dist.get_process_group_ranks(group)
        _kinds[key] = INTRA if len({r // per_node for r in ranks}) <= 1 else INTER
    return _kinds[key]


def record(collective: str, nbytes: int, group=None) -> None:
    """One ``collective`` of ``nbytes`` payload on ``group`` (called by collectives.py)."""
    world = dist.get_world_size(group)
    if world <= 1:
        return
    entry = _counts[(group_kind(group), collective)]
    entry[0] += 1
    entry[1] += nbytes
    share = 1.0 if collective in ("broadcast", "reduce") else (world - 1) / world
    entry[2] += _RING_FACTOR[collective] * share * nbytes


def snapshot(reset: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """``{group kind: {collective: {"calls", "bytes", "ring_bytes"}}}`` since the last reset."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (kind, collective), (calls, nbytes, ring) in sorted(_counts.items()):
        out.setdefault(kind, {})[collective] = {"calls": calls, "bytes": nbytes, "ring_bytes": ring}
    if reset:
        _counts.clear()
    return out


def total(stats: dict, kind: Optional[str] = None, field: str = "bytes") -> float:
    """Sum of ``field`` over the collectives of ``kind`` (None: every kind) in a ``snapshot``."""
    return sum(v[field] for k, per in stats.items() if kind in (None, k) for v in per.values())
