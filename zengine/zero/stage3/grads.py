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

Stage 3's parts of the one ``ShardReducer`` (``..reducer``): the ``RankMajor`` bucket layout, the
codecs ``ReduceScatterRows`` (exact) and ``QuantizedRows`` (ZeRO++ ``zero_quantized_gradients``),
wrapped in ``..mics.Replicated`` under MiCS; the shards land in memory or, with ZeRO-Infinity, in
the swap records (``offload/landing.py``). ``Stage3GradSpec`` names what ``build.py`` gives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ...distributed import collectives
from ...offload.landing import GradLanding, Region, ShardsInMemory, ShardsInSwap
from ...offload.param_swap import on_disk
from ...offload.placement import OptimizerHome
from ...offload.state_swap import GradSwap
from ..bucket_buffers import BucketBuffers
from ..bucket_order import BucketQueue
from ..grad_dtypes import GradDtypes
from ..layout import Bucket, FlatLayout
from ..mics import Replicated, Replication
from ..reducer import ReduceCodec, Reduction, ShardReducer, scaled_codec
from .group import ShardedParamGroup
from .param import ShardedParam
from .quantized import quantized_reduce_scatter


class ExternalUseError(RuntimeError):
    """A stage-3 parameter was used where it is partitioned (outside the engine's forward)."""


class _ChunkView:
    """Adapts a stage-3 group to the bucket queue: spans are the parameters' chunks in shard
    order."""

    def __init__(self, group: ShardedParamGroup):
        # each span runs to the next parameter's offset: the group's chunks may be padded for
        # O_DIRECT
        ends = list(group.offsets[1:]) + [group.shard_numel]
        self.layout = FlatLayout(
            [sp.name for sp in group.sharded],
            [(end - off,) for off, end in zip(group.offsets, ends)],
            1,
        )


class RankMajor:
    """Stage 3's ``BucketLayout``: a bucket is a run of parameters whose buffer is ``[world, sum of
    chunks]``, row r holding every parameter's chunk r; this rank's row of the reduced bucket is its
    shard of them. ``after_grad`` releases a parameter's full data once its gradient is taken."""

    def __init__(
        self,
        groups: list[ShardedParamGroup],
        bucket_numel: int,
        world: int,
        after_grad: Callable[[ShardedParam], None],
        dtypes: GradDtypes,
    ):
        self.groups, self.world = groups, world
        self.after_grad = after_grad
        # Buckets count chunk elements; a bucket of c chunk elements moves world * c elements.
        # each parameter's wire dtype, which a bucket does not mix (torch_autocast)
        self.wires = [dtypes.wires([sp.param for sp in g.sharded]) for g in groups]
        self.queues = [
            BucketQueue(_ChunkView(g), max(1, bucket_numel // world), wires)
            for g, wires in zip(groups, self.wires)
        ]

    def grad(self, gi: int, pi: int) -> Optional[torch.Tensor]:
        return self.groups[gi].sharded[pi].param.grad

    def check(self, gi: int, pi: int) -> None:
        sp = self.groups[gi].sharded[pi]
        grad = sp.param.grad
        # the op saw the released, empty parameter
        if grad is not None and grad.numel() != sp.numel:
            raise ExternalUseError(
                f"stage 3: parameter {sp.name!r} got a gradient of {grad.numel()} elements for its "
                f"{sp.numel}: it was used outside the engine's forward (e.g. a regulariser over "
                f"engine.module.parameters() added to the loss), where a partitioned parameter is "
                f"an empty tensor. Compute the term inside the model's forward: zengine gathers a "
                f"parameter used there, also outside its own module"
            )

    def release(self, gi: int, pi: int) -> None:
        self.after_grad(self.groups[gi].sharded[pi])

    def buffer(self, gi: int, bucket: Bucket, buffers: BucketBuffers) -> torch.Tensor:
        # [world, chunks] on the compute device, like the gathered parameters, in the wire dtype
        device = self.groups[gi].sharded[0].full.device
        shape, wire = (self.world, bucket.numel), self.wires[gi][bucket.params[0]]
        return buffers.get((gi, bucket.index), shape, device, wire)

    def copy_in(self, gi: int, pi: int, buffers: BucketBuffers) -> None:
        sp = self.groups[gi].sharded[pi]
        q = self.queues[gi]
        bucket = q.buckets[q.bucket_of[pi]]
        if self.adopt(gi, bucket, sp, buffers):
            return
        lo, hi = self.place(gi, bucket, pi)
        grad = sp.param.grad.reshape(-1)
        dst = self.buffer(gi, bucket, buffers)[:, lo:hi]  # [world, chunk]
        full_rows, tail = divmod(sp.numel, sp.chunk)
        if full_rows:
            dst[:full_rows].copy_(grad[: full_rows * sp.chunk].view(full_rows, sp.chunk))
        if tail:
            dst[full_rows, :tail].copy_(grad[full_rows * sp.chunk :])
        sp.param.grad = None

    def adopt(self, gi: int, bucket: Bucket, sp: ShardedParam, buffers: BucketBuffers) -> bool:
        """Use the gradient itself as the bucket buffer when the bucket is this one unpadded
        parameter."""
        key = (gi, bucket.index)
        grad = sp.param.grad
        if (
            len(bucket.params) != 1
            or sp.numel != self.world * sp.chunk
            or bucket.numel != sp.chunk
            or key in buffers.live
            or grad.dtype != self.wires[gi][bucket.params[0]]
            or not grad.is_contiguous()
        ):
            return False
        # AccumulateGrad hands a .grad of its own (stolen or cloned), so nothing else aliases it.
        buffers.adopt(key, grad.view(self.world, sp.chunk))  # [world, chunk]
        sp.param.grad = None
        return True

    def place(self, gi: int, bucket: Bucket, pi: int) -> tuple[int, int]:
        # its chunk's columns of the [world, chunks] buffer
        col = self.groups[gi].offsets[pi] - bucket.start
        return col, col + self.groups[gi].sharded[pi].chunk

    def zero_padding(self, gi: int, pi: int, block: torch.Tensor) -> None:
        # the parameter's numel elements fill its [world, chunk] columns row by row: the rest is
        # padding
        sp = self.groups[gi].sharded[pi]
        full_rows, tail = divmod(sp.numel, sp.chunk)
        if tail:
            block[full_rows, tail:].zero_()
            full_rows += 1
        block[full_rows:].zero_()

    def regions(self, gi: int) -> list[Region]:
        return [(bucket.start, bucket.end) for bucket in self.queues[gi].buckets]

    def mine(self, gi: int, bucket: Bucket, reduced: torch.Tensor) -> Optional[torch.Tensor]:
        return reduced  # (the codec kept only this rank's row)


class ReduceScatterRows:
    """``ReduceCodec``: each rank keeps its row of a rank-major bucket summed over the group
    (``collectives.reduce_scatter_rows``: NCCL's reduce-scatter, gloo's all-reduce, or shared
    memory)."""

    def __init__(self, rank: int, comm_group=None):
        self.rank = rank
        self.comm_group = comm_group

    def launch(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> Reduction:
        return Reduction(*collectives.reduce_scatter_rows(buf, self.rank, self.comm_group))


class QuantizedRows:
    """``ReduceCodec``: ZeRO++'s ``zero_quantized_gradients``, each rank's rows sent as int8 or int4
    (``bits``) in an all-to-all and summed in fp32 (``quantized.py``)."""

    def __init__(self, bits: int, comm_group=None):
        self.bits = bits
        self.comm_group = comm_group

    def launch(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> Reduction:
        return Reduction(*quantized_reduce_scatter(buf, self.comm_group, self.bits))


@dataclass(frozen=True)
class Stage3GradSpec:
    """What stage 3's gradient store is built from (``build.py`` names each)."""

    groups: list[ShardedParamGroup]
    bucket_numel: int  # reduce_bucket_size: elements a bucket moves over all ranks
    world: int  # ranks sharded over (MiCS: the shard group)
    rank: int
    # the optimizer's placement: where the gradient shards live, their copies
    placement: OptimizerHome
    # releases a parameter's full data once its gradient is taken
    after_grad: Callable[[ShardedParam], None]
    dtypes: GradDtypes
    comm_group: Any = None
    in_flight: int = 2  # reductions left running while backward goes on
    quantized_bits: int = 0  # zero_quantized_gradients: 8 or 4 (0: exact)
    # MiCS: the copies of each shard across the shard groups
    replication: Replication = Replication()
    # the parameters' registration order, per group
    positions: Optional[Sequence[Sequence[int]]] = None


def _codec(spec: Stage3GradSpec) -> ReduceCodec:
    if spec.quantized_bits and spec.world > 1:
        codec: ReduceCodec = QuantizedRows(spec.quantized_bits, spec.comm_group)
    else:
        codec = ReduceScatterRows(spec.rank, spec.comm_group)
    # MiCS: each reduced shard is summed over the shard groups' copies too
    return Replicated(codec, spec.replication) if spec.replication.count > 1 else codec


def _reducer(spec: Stage3GradSpec, layout: RankMajor, landing: GradLanding) -> ShardReducer:
    buffers = BucketBuffers(spec.dtypes.reduce, spec.placement.copies)
    codec = scaled_codec(_codec(spec), spec.dtypes.scaling)
    return ShardReducer(layout, codec, landing, buffers, spec.in_flight, spec.positions)


def stage3_gradients(spec: Stage3GradSpec) -> ShardReducer:
    """Stage 3's gradient store: rank-major buckets reduced into shards where the optimizer's
    placement keeps master gradients."""
    layout = RankMajor(spec.groups, spec.bucket_numel, spec.world, spec.after_grad, spec.dtypes)
    dtype = spec.dtypes.shard_dtype(spec.placement.cpu_optimizer)
    shards = [
        spec.placement.group_home(gi).empty(g.shard_numel, dtype, g.shard_flat.device)
        for gi, g in enumerate(spec.groups)
    ]
    regions = [layout.regions(gi) for gi in range(len(spec.groups))]
    return _reducer(spec, layout, ShardsInMemory(shards, regions, spec.placement.copies))


def swapped_stage3_gradients(spec: Stage3GradSpec, sink: GradSwap) -> ShardReducer:
    """ZeRO-Infinity's: each reduced bucket's shard goes to the optimizer's swap records (``sink``),
    added there under accumulation; nothing is stored but the sums of squares written (the global
    norm)."""
    layout = RankMajor(spec.groups, spec.bucket_numel, spec.world, spec.after_grad, spec.dtypes)
    shards = [on_disk() for _ in spec.groups]  # in the swap file, fp32
    regions = [layout.regions(gi) for gi in range(len(spec.groups))]
    return _reducer(spec, layout, ShardsInSwap(sink, shards, regions, spec.placement.copies))
