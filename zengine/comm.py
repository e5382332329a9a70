"""Thin, stateless collective functions over torch.distributed.

The engine calls collectives only through this module, so that tests can
patch them and the choice of collective per backend lives in one place.
The choice follows measurement, not names: on gloo (CPU) a broadcast from
each owner moves a sharded buffer to every rank about three times faster
than ``all_gather``, and ``all_reduce`` is faster than ``reduce_scatter``
(see shared/MEASURED.md and benchmarks/); NCCL prefers the native
all-gather and reduce-scatter.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Work = Optional[dist.Work]


def is_gloo(group=None) -> bool:
    """True when the group's backend is gloo (the CPU path)."""
    return dist.get_backend(group) == "gloo"


def all_reduce_sum(tensor: torch.Tensor, group=None, async_op: bool = False) -> Work:
    """Sum ``tensor`` in place over the group."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def reduce_sum_to(tensor: torch.Tensor, dst: int, group=None, async_op: bool = False) -> Work:
    """Sum ``tensor`` over the group into rank ``dst`` (others keep garbage)."""
    return dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False) -> Work:
    """Copy ``tensor`` from rank ``src`` to every rank of the group."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def gather_rows(rows: list, rank: int, group=None, async_op: bool = False) -> list:
    """Fill ``rows[r]`` on every rank from rank r's own ``rows[r]`` (an all-gather into given views).

    gloo: one broadcast per owner (measured about three times faster than its all_gather);
    otherwise the backend's all_gather. Returns the pending works when ``async_op``.
    """
    if len(rows) == 1:
        return []
    if is_gloo(group):
        works = [dist.broadcast(row, src=_global_rank(r, group), group=group, async_op=async_op)
                 for r, row in enumerate(rows)]
    else:
        works = [dist.all_gather(rows, rows[rank].clone(), group=group, async_op=async_op)]
    return [w for w in works if w is not None]


def gather_strided(full: torch.Tensor, shard_numel: int, lo: int, hi: int, rank: int, world: int, group=None) -> None:
    """Gather the sub-range ``[lo, hi)`` of every rank's shard of ``full`` (one all-gather bucket)."""
    if world == 1 or hi <= lo:
        return
    gather_rows([full.narrow(0, r * shard_numel + lo, hi - lo) for r in range(world)], rank, group)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False) -> Work:
    """Sum ``full`` ([world * n]) over the group; this rank keeps its n-element part in ``out``."""
    return dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(outs: list, tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` into ``outs`` (small control messages)."""
    dist.all_gather(outs, tensor, group=group)


def _global_rank(group_rank: int, group) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
