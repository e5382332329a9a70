"""Stage 2's gradient parts: buckets that are contiguous ranges of each flat group buffer, and the
exact codecs that reduce them (every rank sums the whole bucket, or each owner only its part of it).

A bucket's buffer is ``[bucket]`` in the reduce dtype, on the group's device; each rank keeps the
part of the reduced bucket that falls inside its shard of the flat buffer
(``FlatParamGroup.owned``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..distributed import collectives
from ..offload.landing import Region, ShardsInMemory
from ..offload.placement import OptimizerHome
from .bucket_buffers import BucketBuffers
from .bucket_order import BucketQueue
from .flat_group import FlatParamGroup
from .grad_dtypes import GradDtypes
from .layout import Bucket, intersect
from .reducer import Reduction, ShardReducer, scaled_codec


class FlatRanges:
    """Stage 2's ``BucketLayout``: each bucket a contiguous range of its group's flat buffer."""

    def __init__(
        self,
        groups: list[FlatParamGroup],
        bucket_numel: int,
        wires: Optional[Sequence[Sequence[torch.dtype]]] = None,
    ):
        self.groups = groups
        self.wires = wires
        # (wires: per group, each parameter's wire dtype, which a bucket does not mix)
        self.queues = [
            BucketQueue(g, bucket_numel, wires[gi] if wires else None)
            for gi, g in enumerate(groups)
        ]
        for g in groups:
            for p in g.params:
                p.grad = None

    def grad(self, gi: int, pi: int) -> Optional[torch.Tensor]:
        return self.groups[gi].params[pi].grad

    def check(self, gi: int, pi: int) -> None:
        """Any gradient a parameter gets fits its place."""

    def release(self, gi: int, pi: int) -> None:
        """Nothing but the gradient to let go."""

    def buffer(self, gi: int, bucket: Bucket, buffers: BucketBuffers) -> torch.Tensor:
        # [bucket] in its wire dtype (the reduce dtype, or under torch_autocast its parameters')
        wire = self.wires[gi][bucket.params[0]] if self.wires and bucket.params else None
        return buffers.get((gi, bucket.index), (bucket.numel,), self.groups[gi].flat.device, wire)

    def copy_in(self, gi: int, pi: int, buffers: BucketBuffers) -> None:
        q = self.queues[gi]
        bucket = q.buckets[q.bucket_of[pi]]
        p = self.groups[gi].params[pi]
        lo, hi = self.place(gi, bucket, pi)
        # (converted to the reduce dtype)
        self.buffer(gi, bucket, buffers)[lo:hi].copy_(p.grad.reshape(-1))
        p.grad = None

    def place(self, gi: int, bucket: Bucket, pi: int) -> tuple[int, int]:
        span = self.groups[gi].layout.spans[pi]
        return span.offset - bucket.start, span.offset - bucket.start + span.numel

    def zero_padding(self, gi: int, pi: int, block: torch.Tensor) -> None:
        """A gradient fills its place whole."""

    def _owned_part(self, gi: int, bucket: Bucket) -> Optional[tuple[int, int]]:
        return intersect((bucket.start, bucket.end), self.groups[gi].owned)

    def regions(self, gi: int) -> list[Region]:
        lo0 = self.groups[gi].owned[0]
        out = []
        for bucket in self.queues[gi].buckets:
            piece = self._owned_part(gi, bucket)
            out.append((piece[0] - lo0, piece[1] - lo0) if piece else None)
        return out

    def mine(self, gi: int, bucket: Bucket, reduced: torch.Tensor) -> Optional[torch.Tensor]:
        piece = self._owned_part(gi, bucket)
        return reduced[piece[0] - bucket.start : piece[1] - bucket.start] if piece else None


class AllReduce:
    """``ReduceCodec``: every rank sums the whole bucket (``reduce_scatter`` false)."""

    def __init__(self, comm_group=None):
        self.comm_group = comm_group

    def launch(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> Reduction:
        return Reduction([collectives.all_reduce_sum(buf, self.comm_group, async_op=True)], buf)


class ReduceToOwners:
    """``ReduceCodec``: each owner of a part of a flat bucket receives only that part's sum
    (``collectives.reduce_to_owners``); the other parts of its buffer are left as they were."""

    def __init__(self, groups: list[FlatParamGroup], comm_group=None):
        self.groups = groups
        self.comm_group = comm_group

    def launch(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> Reduction:
        g = self.groups[gi]
        pieces = [
            (owner, lo - bucket.start, hi - bucket.start)
            for owner, lo, hi in g.layout.owner_ranges((bucket.start, bucket.end))
        ]
        return Reduction(collectives.reduce_to_owners(buf, pieces, g.rank, self.comm_group), buf)


def sharded_gradients(
    groups: list[FlatParamGroup],
    *,
    bucket_numel: int,
    dtypes: GradDtypes,
    to_owners: bool,
    placement: OptimizerHome,
    comm_group=None,
    in_flight: int = 1,
    positions: Optional[Sequence[Sequence[int]]] = None,
) -> ShardReducer:
    """Stage 2's gradient store: flat-range buckets, reduced exactly (``to_owners``: each owner sums
    only its part, ``zero_optimization.reduce_scatter``; else all-reduced), into shards where
    ``placement`` (the optimizer's) keeps master gradients."""
    dtype = dtypes.shard_dtype(placement.cpu_optimizer)
    shards = [placement.empty(g.layout.shard_numel, dtype, g.flat.device) for g in groups]
    wires = [dtypes.wires(g.params) for g in groups]
    layout = FlatRanges(groups, bucket_numel, wires)
    codec = ReduceToOwners(groups, comm_group) if to_owners else AllReduce(comm_group)
    codec = scaled_codec(codec, dtypes.scaling)
    regions = [layout.regions(gi) for gi in range(len(groups))]
    landing = ShardsInMemory(shards, regions, placement.copies)
    buffers = BucketBuffers(dtypes.reduce, placement.copies)
    return ShardReducer(layout, codec, landing, buffers, in_flight, positions)
