"""Stage-3 gradients: reduced bucket by bucket into each rank's shard during backward.

A bucket is a run of parameters (in reverse registration order, as
gradients arrive) whose buffer is laid out rank-major, ``[world, sum of
chunks]``, so that row r holds every parameter's chunk r: one reduce-scatter
(NCCL) or one all-reduce whose row r is kept (gloo, measured faster) leaves
each rank exactly its shard of every parameter in the bucket. A parameter's
full gradient is freed as soon as it is copied into its bucket, and its full
data as soon as its gradient is done (nothing in backward needs it after).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from ... import comm
from ..grads import MAX_BUCKETS_IN_FLIGHT, _BucketQueue
from ..layout import Bucket, FlatLayout
from .group import ShardedParamGroup
from .param import ShardedParam


class _ChunkView:
    """Adapts a stage-3 group to the bucket queue: spans are the parameters' chunks in shard order."""

    def __init__(self, group: ShardedParamGroup):
        self.layout = FlatLayout([sp.name for sp in group.sharded], [(sp.chunk,) for sp in group.sharded], 1)


class Stage3Gradients:
    """Gradient shards, filled by reducing rank-major buckets during backward."""

    def __init__(self, groups: list[ShardedParamGroup], bucket_numel: int, world: int, rank: int, placement,
                 after_grad: Callable[[ShardedParam], None], comm_group=None):
        self.groups, self.world, self.rank, self.comm_group = groups, world, rank, comm_group
        self.after_grad = after_grad  # releases the parameter's full data
        self.use_reduce_scatter = dist.get_backend(comm_group) != "gloo"
        dtype = torch.float32 if placement.cpu_optimizer else None
        self.shards = [placement.empty(g.shard_numel, dtype or g.shard_flat.dtype, g.shard_flat.device)
                       for g in groups]  # [sum of chunks] per group
        # Buckets count chunk elements; a bucket of c chunk elements moves world * c elements.
        self.queues = [_BucketQueue(_ChunkView(g), max(1, bucket_numel // world)) for g in groups]
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.copied: set[tuple[int, int]] = set()
        self.in_flight: deque = deque()
        self.sync = True

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        self.sync = not no_sync

    def _buffer(self, gi: int, bucket: Bucket) -> torch.Tensor:
        key = (gi, bucket.index)
        if key not in self.buffers:
            g = self.groups[gi]
            self.buffers[key] = torch.zeros(self.world, bucket.numel, dtype=g.shard_flat.dtype,
                                            device=g.shard_flat.device)  # [world, bucket chunks] compute dtype
        return self.buffers[key]

    def _copy_in(self, gi: int, pi: int) -> None:
        g = self.groups[gi]
        sp = g.sharded[pi]
        q = self.queues[gi]
        bucket = q.buckets[q.bucket_of[pi]]
        col = g.offsets[pi] - bucket.start
        grad = sp.param.grad.reshape(-1)
        dst = self._buffer(gi, bucket)[:, col:col + sp.chunk]  # [world, chunk]
        full_rows, tail = divmod(sp.numel, sp.chunk)
        if full_rows:
            dst[:full_rows].copy_(grad[:full_rows * sp.chunk].view(full_rows, sp.chunk))
        if tail:
            dst[full_rows, :tail].copy_(grad[full_rows * sp.chunk:])
        sp.param.grad = None
        self.copied.add((gi, pi))

    def on_grad(self, gi: int, pi: int) -> None:
        sp = self.groups[gi].sharded[pi]
        if self.sync:
            self._copy_in(gi, pi)
            for bucket in self.queues[gi].mark_ready(pi):
                self._launch(gi, bucket)
        self.after_grad(sp)

    def _launch(self, gi: int, bucket: Bucket) -> None:
        g = self.groups[gi]
        for pi in bucket.params:
            if (gi, pi) not in self.copied and g.sharded[pi].param.grad is not None:
                self._copy_in(gi, pi)
        while len(self.in_flight) >= MAX_BUCKETS_IN_FLIGHT:
            self._complete(*self.in_flight.popleft())
        buf = self._buffer(gi, bucket)
        if self.use_reduce_scatter:
            out = torch.empty(bucket.numel, dtype=buf.dtype, device=buf.device)
            work = dist.reduce_scatter_tensor(out, buf.view(-1), group=self.comm_group, async_op=True)
        else:
            out = None
            work = comm.all_reduce_sum(buf, self.comm_group, async_op=True)
        self.in_flight.append((gi, bucket, work, out))

    def _complete(self, gi: int, bucket: Bucket, work, out) -> None:
        work.wait()
        buf = self.buffers.pop((gi, bucket.index))
        mine = out if out is not None else buf[self.rank]
        shard = self.shards[gi]
        shard[bucket.start:bucket.end].add_(mine.to(shard.device))

    def end_backward(self) -> None:
        if self.sync:
            for gi, q in enumerate(self.queues):
                for bucket in q.pop_ready(flush=True):
                    self._launch(gi, bucket)
                q.reset()
            self.copied.clear()
        while self.in_flight:
            self._complete(*self.in_flight.popleft())

    def owned_grad(self, gi: int) -> torch.Tensor:
        return self.shards[gi]

    def zero(self) -> None:
        for s in self.shards:
            s.zero_()

    def tensors(self) -> list[torch.Tensor]:
        return list(self.shards) + list(self.buffers.values())
