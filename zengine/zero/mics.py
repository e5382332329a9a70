"""MiCS (``mics_shard_size``): stage 3 shards inside groups of ranks and replicates across the
groups.

Plain stage 3 shards every parameter over all W data-parallel ranks, so every gather and every
gradient reduction spans the whole cluster. MiCS cuts the W ranks into W / m *shard groups* of m
consecutive ranks (a node, or a few): the model states are sharded over a group, the same way stage
3 shards them over everyone, and each group holds a whole copy. Parameter gathers then stay inside
the group; the gradients are reduce-scattered inside the group and the resulting shard is
all-reduced across the *replica group* (the W / m ranks holding the same shard, one per shard
group). Memory per rank is the stage-3 formula with m in place of W.

Everything that shards (the fetcher, the gradient buckets, zero.Init's cuts) sees ``ShardGroup(world=m,
rank=rank % m, group=shard group)``; ``Replication`` tells the optimizer the rest: how many copies
of each shard exist, which one this rank holds, and the replica group for the gradient all-reduce;
the default group (MiCS cuts the whole world) serves the step's agreement (norm, ranks in step,
gathers agreed) and checkpoints. Only copy 0 counts its shards in the gradient norm and writes them
to a checkpoint, so a MiCS checkpoint is a plain stage-3 checkpoint of world m, loadable at any
world size and stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..distributed import collectives
from .layout import Bucket
from .reducer import ReduceCodec, Reduction

if TYPE_CHECKING:  # annotations only
    from ..config.zero import ZeroConfig


class MicsConfigError(ValueError):
    """mics_shard_size does not cut the data-parallel world into equal groups."""


@dataclass(frozen=True)
class Replication:
    """How many ranks hold each shard. The default: one (plain sharding, nothing replicated)."""

    count: int = 1  # copies of every shard: W / mics_shard_size
    index: int = 0  # which copy this rank holds (its shard group's number)
    group: Any = None  # the ranks holding the same shard as this one (the replica group)

    @property
    def primary(self) -> bool:
        """This rank's copy is the one counted in the gradient norm and written to checkpoints."""
        return self.index == 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the copies (in place; nothing with one copy)."""
        if self.count > 1:
            collectives.all_reduce_sum(tensor, self.group)


class Replicated:
    """``ReduceCodec`` of MiCS's gradients: ``inner`` reduces a bucket inside the shard group, then
    this rank's reduced part is summed over the copies of its shard in the other shard groups."""

    def __init__(self, inner: ReduceCodec, replication: Replication):
        self.inner = inner
        self.replication = replication

    def launch(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> Reduction:
        inside = self.inner.launch(gi, bucket, buf)
        return Reduction(inside.works, lambda: self._across(inside.result()))

    def _across(self, mine: torch.Tensor) -> torch.Tensor:
        self.replication.all_reduce(mine)
        return mine


# (world, shard size) -> (shard group, replica group)
_groups: dict[tuple[int, int], tuple[Any, Any]] = {}


def groups(size: int) -> tuple[Any, Any]:
    """This rank's (shard group, replica group) for shard groups of ``size`` consecutive ranks of
    the default group, made once per process (every rank makes every group, in the same order:
    torch's rule)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    _check_divides(size, world)
    key = (world, size)
    if key not in _groups:
        shard = replica = None
        for first in range(0, world, size):
            g = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                shard = g
        for local in range(size):
            g = dist.new_group(list(range(local, world, size)))
            if rank % size == local:
                replica = g
        _groups[key] = (shard, replica)
    return _groups[key]


def shard_size(zero_cfg: Optional[ZeroConfig], world: int) -> int:
    """The ranks stage 3 shards over: ``mics_shard_size`` when it asks for MiCS, else ``world``."""
    size = int(getattr(zero_cfg, "mics_shard_size", -1) or -1)
    if int(getattr(zero_cfg, "stage", 0)) < 3 or size <= 0 or size == world:
        return world
    _check_divides(size, world)
    return size


def _check_divides(size: int, world: int) -> None:
    if size < 1 or world % size:
        raise MicsConfigError(
            f"mics_shard_size {size} must divide the data-parallel world size {world} (it cuts the "
            f"ranks into groups of consecutive ranks, each holding a whole sharded copy)"
        )


def sharding(
    zero_cfg: Optional[ZeroConfig], world: int, rank: int
) -> tuple[int, int, Any, Replication]:
    """(ranks sharded over, this rank among them, their group, Replication) for ``zero_cfg`` on the
    default group of ``world`` ranks: the whole world and no replication unless ``mics_shard_size``
    asks for MiCS."""
    size = shard_size(zero_cfg, world)
    if size == world:
        return world, rank, None, Replication()
    shard, replica = groups(size)
    replication = Replication(count=world // size, index=rank // size, group=replica)
    return size, rank % size, shard, replication
