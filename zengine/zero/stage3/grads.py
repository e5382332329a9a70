"""Stage-3 gradients: reduced bucket by bucket into each rank's shard during backward.

A bucket is a run of parameters (in reverse registration order, as
gradients arrive) whose buffer is laid out rank-major, ``[world, sum of
chunks]``, so that row r holds every parameter's chunk r: one
``collectives.reduce_scatter_rows`` (NCCL's reduce-scatter, gloo's all-reduce
whose row r is kept, or shared memory) leaves each rank exactly its shard of
every parameter in the bucket. A parameter's
full gradient is freed as soon as it is copied into its bucket, and its full
data as soon as its gradient is done (nothing in backward needs it after).

A bucket that holds one parameter whose elements divide evenly into the
chunks (most large weights) needs no buffer: autograd's fresh gradient,
viewed ``[world, chunk]``, already is the rank-major layout, so it is
reduced in place, with no copy and no second gradient-sized allocation, when
the reduce dtype is autograd's; with another (``communication_data_type``)
every gradient is copied into a buffer in that dtype. Shards hold the sum over
micro-steps in the accumulate dtype (``..grad_dtypes``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...distributed import collectives
from ..grad_dtypes import GradDtypes
from ..bucket_order import BucketQueue
from ..grads import ShardReducer
from ..layout import Bucket, FlatLayout
from ..mics import Replication
from .group import ShardedParamGroup
from ...offload.param_swap import on_disk
from .param import ShardedParam
from .quantized import quantized_reduce_scatter


class ExternalUseError(RuntimeError):
    """A stage-3 parameter was used where it is partitioned (outside the engine's forward)."""


class _ChunkView:
    """Adapts a stage-3 group to the bucket queue: spans are the parameters' chunks in shard order."""

    def __init__(self, group: ShardedParamGroup):
        # each span runs to the next parameter's offset: the group's chunks may be padded for O_DIRECT
        ends = list(group.offsets[1:]) + [group.shard_numel]
        self.layout = FlatLayout([sp.name for sp in group.sharded],
                                 [(end - off,) for off, end in zip(group.offsets, ends)], 1)


class Stage3Gradients(ShardReducer):
    """Stage 3: rank-major bucket buffers; each rank keeps its row."""

    def __init__(self, groups: list[ShardedParamGroup], bucket_numel: int, world: int, rank: int, placement,
                 after_grad: Callable[[ShardedParam], None], dtypes: GradDtypes, comm_group=None,
                 in_flight: int = 2, quantized_bits: int = 0, replication: Replication = Replication(),
                 positions=None):
        self.groups, self.world, self.rank = groups, world, rank
        self.replication = replication  # MiCS: each reduced shard is summed over the shard groups' copies too
        self.after_grad = after_grad  # releases the parameter's full data
        self.quantized_bits = quantized_bits if world > 1 else 0  # zero_quantized_gradients: 8 or 4 (0: exact)
        shards = self._make_shards(groups, placement, dtypes.shard_dtype(placement.cpu_optimizer))
        # Buckets count chunk elements; a bucket of c chunk elements moves world * c elements.
        super().__init__([BucketQueue(_ChunkView(g), max(1, bucket_numel // world)) for g in groups], shards,
                         placement.copies, dtypes, comm_group, in_flight, positions)
        self._direct: set[tuple[int, int]] = set()  # (group, bucket) reduced in autograd's gradient itself

    def on_grad(self, gi: int, pi: int) -> None:
        # The full parameter is released before the launch, which may wait for an earlier bucket:
        # so the wait never holds the parameter and its gradient's copy together.
        sp = self.groups[gi].sharded[pi]
        grad = sp.param.grad
        if grad is not None and grad.numel() != sp.numel:  # the op saw the released, empty parameter
            raise ExternalUseError(
                f"stage 3: parameter {sp.name!r} got a gradient of {grad.numel()} elements for its {sp.numel}: it "
                f"was used outside the engine's forward (e.g. a regulariser over engine.module.parameters() "
                f"added to the loss), where a partitioned parameter is an empty tensor. Compute the term inside "
                f"the model's forward: zengine gathers a parameter used there, also outside its own module")
        if self.sync:
            self._take(gi, pi)
        self.after_grad(sp)
        if self.sync:
            self._launch_ready(gi, pi)

    def _grad(self, gi: int, pi: int) -> Optional[torch.Tensor]:
        return self.groups[gi].sharded[pi].param.grad

    def _buffer(self, gi: int, bucket: Bucket) -> torch.Tensor:
        key = (gi, bucket.index)
        if key not in self.buffers:
            # [world, chunks] on the compute device, like the gathered parameters, in the reduce dtype
            self._new_buffer(key, (self.world, bucket.numel), self.groups[gi].sharded[0].full.device)
        return self.buffers[key]

    def _copy_in(self, gi: int, pi: int) -> None:
        g = self.groups[gi]
        sp = g.sharded[pi]
        bucket = self._bucket_of(gi, pi)
        if self._adopt(gi, bucket, sp):
            return
        lo, hi = self._place(gi, bucket, pi)
        grad = sp.param.grad.reshape(-1)
        dst = self._buffer(gi, bucket)[:, lo:hi]  # [world, chunk]
        full_rows, tail = divmod(sp.numel, sp.chunk)
        if full_rows:
            dst[:full_rows].copy_(grad[:full_rows * sp.chunk].view(full_rows, sp.chunk))
        if tail:
            dst[full_rows, :tail].copy_(grad[full_rows * sp.chunk:])
        sp.param.grad = None

    def _zero_unwritten_in(self, gi: int, bucket: Bucket, buf: torch.Tensor, written: list[int]) -> None:
        if (gi, bucket.index) not in self._direct:  # (an adopted gradient is whole: nothing unwritten)
            super()._zero_unwritten_in(gi, bucket, buf, written)

    def _place(self, gi: int, bucket: Bucket, pi: int) -> tuple[int, int]:
        col = self.groups[gi].offsets[pi] - bucket.start  # its chunk's columns of the [world, chunks] buffer
        return col, col + self.groups[gi].sharded[pi].chunk

    def _zero_padding(self, gi: int, pi: int, block: torch.Tensor) -> None:
        # the parameter's numel elements fill its [world, chunk] columns row by row: the rest is padding
        sp = self.groups[gi].sharded[pi]
        full_rows, tail = divmod(sp.numel, sp.chunk)
        if tail:
            block[full_rows, tail:].zero_()
            full_rows += 1
        block[full_rows:].zero_()

    def _adopt(self, gi: int, bucket: Bucket, sp: ShardedParam) -> bool:
        """Use the gradient itself as the bucket buffer when the bucket is this one unpadded parameter."""
        key = (gi, bucket.index)
        grad = sp.param.grad
        if (len(bucket.params) != 1 or sp.numel != self.world * sp.chunk or bucket.numel != sp.chunk
                or key in self.buffers
                or grad.dtype != self.dtypes.reduce or not grad.is_contiguous()):
            return False
        # AccumulateGrad hands a .grad of its own (stolen or cloned), so nothing else aliases it.
        self.buffers[key] = grad.view(self.world, sp.chunk)  # [world, chunk]
        self._direct.add(key)
        sp.param.grad = None
        return True

    def _recycle(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> None:
        # An adopted gradient is dropped, not pooled: pooling them would keep every one alive.
        if (gi, bucket.index) in self._direct:
            self._direct.discard((gi, bucket.index))
        else:
            super()._recycle(gi, bucket, buf)

    @staticmethod
    def _make_shards(groups: list[ShardedParamGroup], placement, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's gradient shard of each group in ``dtype``, where the placement keeps master gradients."""
        return [placement.empty(g.shard_numel, dtype, g.shard_flat.device) for g in groups]

    def _reduce(self, gi: int, bucket: Bucket, buf: torch.Tensor):
        if self.quantized_bits:  # zero_quantized_gradients: int8/int4 all-to-all, summed in fp32 (quantized.py)
            return quantized_reduce_scatter(buf, self.comm_group, self.quantized_bits)
        return collectives.reduce_scatter_rows(buf, self.rank, self.comm_group)

    def _region(self, gi: int, bucket: Bucket) -> torch.Tensor:
        return self.shards[gi][bucket.start:bucket.end]

    def _accumulate(self, gi: int, bucket: Bucket, buf: torch.Tensor, out) -> None:
        self._add(gi, bucket, self._mine(buf, out))

    def _mine(self, buf: torch.Tensor, out) -> torch.Tensor:
        """This rank's reduced part: the reduce-scatter's output, the quantized sum, or its row of the all-reduce;
        with MiCS then summed over the copies of this shard in the other shard groups."""
        mine = out() if callable(out) else out
        self.replication.all_reduce(mine)
        return mine


class SwappedStage3Gradients(Stage3Gradients):
    """ZeRO-Infinity: each reduced bucket's shard goes to the optimizer's swap records (``sink``, a
    ``GradSwap``), added there under accumulation; nothing is stored here but the sums of squares
    written, which give the global norm."""

    def __init__(self, *args, sink, **kwargs):
        self.sink = sink
        self.sq: dict[tuple[int, int], torch.Tensor] = {}  # (group, bucket) -> sum of squares written
        super().__init__(*args, **kwargs)

    @staticmethod
    def _make_shards(groups: list[ShardedParamGroup], placement, dtype: torch.dtype) -> list[torch.Tensor]:
        return [on_disk() for _ in groups]  # in the swap file, fp32

    def _accumulate(self, gi: int, bucket: Bucket, buf: torch.Tensor, out) -> None:
        self.sq[(gi, bucket.index)] = self.sink.accumulate(gi, bucket.start, bucket.end, self._mine(buf, out))

    def owned_grad(self, gi: int) -> torch.Tensor:
        self.drain()
        return self.sink.read(gi)

    def swapped_sq(self) -> torch.Tensor:
        """The sum of squares of the summed gradient shards (as written to the swap file): 0-dim float64."""
        return torch.stack(list(self.sq.values())).sum() if self.sq else torch.zeros((), dtype=torch.float64)

    def zero(self) -> None:
        self.sink.reset()
        self.sq.clear()
