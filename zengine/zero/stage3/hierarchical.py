"""ZeRO++'s hierarchical partitioning (hpZ, ``zero_hpz_partition_size``): the backward gathers stay
on the node.

Stage 3 gathers each parameter twice per micro-step, for the forward and for the backward, both
across every rank. With hpZ, when the forward's gather completes each rank also keeps a secondary
shard: its 1/h of the whole parameter, h = ``zero_hpz_partition_size`` consecutive ranks (a node:
set it to the GPUs per node). The backward then gathers from those h ranks only, so the second
gather never leaves the node. The secondary shards cost 1/h of the gathered parameters' size per
rank, and live for one forward-backward: they are dropped when the backward ends (the step then
changes the primary shards they came from), and a gather the user asks for (``GatheredParameters``,
``summon_full_params``) always uses the primary shards.

The secondary shard of a parameter is the h-way split of its padded full storage (``world * chunk``
elements, rank-major), so it needs ``world`` to be a multiple of h; rank r holds piece ``r % h``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import torch
import torch.distributed as dist

from ...distributed import collectives
from .gather import InFlightGather
from .param import ShardedParam

if TYPE_CHECKING:  # annotations only
    from ...config.zero import ZeroConfig


class HpzConfigError(ValueError):
    """zero_hpz_partition_size does not divide the world into groups of consecutive ranks."""


class SecondaryShards(Protocol):
    """Where the backward's gathers may come from instead of every rank: ``SecondaryPartition``
    (hpZ) or ``NoSecondaryPartition`` (every gather spans every rank)."""

    def begin(self, training: bool) -> None:
        """A forward starts; a training one keeps secondary shards for its backward."""
        ...

    def end(self) -> None:
        """The backward is over: drop the secondary shards."""
        ...

    def keep(self, params: Sequence[ShardedParam]) -> None:
        """After a gather across every rank: keep this rank's secondary shards of ``params``."""
        ...

    def ready(self, params: Sequence[ShardedParam]) -> bool:
        """Whether ``params`` can be gathered from the secondary shards."""
        ...

    def start(self, params: Sequence[ShardedParam]) -> InFlightGather:
        """Gather ``params`` from the secondary shards (only when ``ready``)."""
        ...


class NoSecondaryPartition:
    """No hpZ: nothing kept, every gather spans every rank."""

    def begin(self, training: bool) -> None:
        """Nothing to keep."""

    def end(self) -> None:
        """Nothing kept."""

    def keep(self, params: Sequence[ShardedParam]) -> None:
        """Nothing to keep."""

    def ready(self, params: Sequence[ShardedParam]) -> bool:
        """Never: there are no secondary shards."""
        return False

    def start(self, params: Sequence[ShardedParam]) -> InFlightGather:
        """Not called (never ``ready``)."""
        raise RuntimeError(
            "stage 3: no secondary partition to gather from (zero_hpz_partition_size)"
        )


class SecondaryPartition:
    """This rank's secondary shards and its node group (see the module doc)."""

    def __init__(self, size: int, world: int, rank: int):
        if size < 1 or world % size:
            raise HpzConfigError(
                f"zero_hpz_partition_size {size} must divide the data-parallel "
                f"world size {world} (it groups consecutive ranks: the GPUs of a "
                f"node)"
            )
        self.size, self.local = size, rank % size
        self.group = None
        # every rank makes every group, in the same order (torch's rule)
        for first in range(0, world, size):
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                self.group = group
        # id(ShardedParam) -> this rank's piece of the full parameter
        self.held: dict[int, torch.Tensor] = {}
        self.active = False  # inside a training forward-backward

    def begin(self, training: bool) -> None:
        """A forward starts; a training one keeps secondary shards for its backward."""
        self.active = training

    def end(self) -> None:
        """The backward is over (the step will change the primary shards): drop the secondary
        shards."""
        self.held.clear()
        self.active = False

    def keep(self, params: Sequence[ShardedParam]) -> None:
        """After a gather across every rank: copy this rank's piece of each whole parameter."""
        if self.active:
            for sp in params:
                self.held[id(sp)] = sp.full.view(self.size, -1)[self.local].clone()

    def ready(self, params: Sequence[ShardedParam]) -> bool:
        """In a training forward-backward, with a secondary shard of each of ``params``."""
        return self.active and all(id(sp) in self.held for sp in params)

    def start(self, params: Sequence[ShardedParam]) -> InFlightGather:
        """Gather ``params`` from the node's secondary shards (asynchronous)."""
        widths = [sp.full.numel() // self.size for sp in params]
        dtype, device = params[0].full.dtype, params[0].full.device
        # [h, sum of pieces]
        staging = torch.empty(self.size, sum(widths), dtype=dtype, device=device)
        col = 0
        for sp in params:
            piece = self.held[id(sp)]
            staging[self.local, col : col + piece.numel()].copy_(piece)
            col += piece.numel()
        works = collectives.all_gather_rows(staging, self.local, self.group, async_op=True)
        return InFlightGather(list(params), staging, works, widths, from_secondary=True)


def secondary_partition(zero_cfg: ZeroConfig, world: int, rank: int) -> SecondaryShards:
    """hpZ when the config asks for it (``zero_hpz_partition_size`` above 1 and below the world
    size), else ``NoSecondaryPartition``."""
    size = int(getattr(zero_cfg, "zero_hpz_partition_size", 1) or 1)
    if size <= 1 or size >= world:  # one rank per group, or the group is everyone: nothing to gain
        return NoSecondaryPartition()
    if world != dist.get_world_size():
        raise HpzConfigError(
            "zero_hpz_partition_size: hierarchical partitioning groups the ranks "
            "of the default process group; this engine shards over a smaller "
            "group"
        )
    return SecondaryPartition(size, world, rank)
