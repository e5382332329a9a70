"""Where gradients live and how they are reduced across ranks.

``FullGradients`` (stages 0 and 1): every rank keeps a full flat gradient
buffer, the parameters' ``.grad`` are views into it, and buckets are
all-reduced from gradient hooks as soon as all their parameters are ready,
so communication overlaps the rest of backward. A second synchronised
backward before the step (``backward(l1); backward(l2)``) first divides the
already summed buffer by the world size, so that its all-reduce adds each
rank's new gradient to the old sum once, not W times (the sum of W equal
copies of sum/W), as DDP's averaging does implicitly.

``ShardedGradients`` (stage 2): each gradient is copied into a bucket buffer
as soon as autograd produces it and freed; a full bucket is reduced and each
rank keeps only the part that falls in its shard. At most ``in_flight``
buckets are still being reduced while backward goes on (2 with
``overlap_comm``, else none: each completes at once), so no rank ever holds
the whole gradient: the gradient transient of a step is ``in_flight + 1``
buckets of ``reduce_bucket_size`` elements.

A bucket buffer is not zeroed: every gradient is copied into its place, and
only what no gradient wrote (padding, parameters without a gradient) is zeroed
when the bucket launches. (Letting autograd accumulate into a zeroed bucket
through ``.grad`` views costs a fill and an add where a copy does: measured
on CPU, W=1, the 21M GPT: 40 ms of a 0.44 s backward.)

Buckets launch in one sequence over every group, the same on every rank (``bucket_order.py``): collectives
are matched by order, so a bucket waiting for a parameter that this rank did not use holds back the ones
after it until the end of backward.

Bucket buffers are in the reduce dtype (each gradient converted as it is
copied in) and the sums over micro-steps in the accumulate dtype (``grad_dtypes.py``).
"""
from __future__ import annotations

import zlib
from collections import deque
from typing import Optional

import torch

from ..distributed import collectives
from ..ops.grad import sum_of_squares
from .flat_group import FlatParamGroup
from .grad_dtypes import GradDtypes
from .bucket_order import BucketQueue, LaunchSequence
from .layout import Bucket, intersect


def buckets_in_flight(overlap_comm: bool) -> int:
    """Reductions left running while backward goes on. With ``overlap_comm`` two, so that one reduction
    overlaps the next bucket's; without, none, DeepSpeed's meaning: each bucket's reduction completes
    before backward continues (on a GPU that orders the streams; on CPU the rank waits), the least
    memory. Measured on CPU gloo (bench_zero, W=2): stage 2 1.07x DDP without, 1.06x with one."""
    return 2 if overlap_comm else 0


class GradientStore:
    """What every gradient store shares: reducing at the step what backwards under ``no_sync`` left
    local, and the first step's agreement on the bucket launch order (none by default)."""

    unreduced = False  # a backward without reduction (accumulation, no_sync) left local gradients

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        raise NotImplementedError

    def end_backward(self) -> None:
        raise NotImplementedError

    def reduce_pending(self) -> None:
        """Reduce the gradients that backwards without reduction left local (the last backward before
        the boundary ran under ``no_sync``): the step must see the sum over ranks."""
        if self.unreduced:
            self.begin_backward(True, False)
            self.end_backward()

    def order_digests(self) -> tuple[int, int]:
        """Digests of the bucket launch order this rank proposes; (0, 0): none to agree on."""
        return 0, 0

    def settle_order(self, agreed: bool) -> None:
        """Fix the bucket launch order at the first boundary step (nothing to fix by default)."""

    def workspace(self) -> list[torch.Tensor]:
        """Storage kept for reuse, holding no gradient (released bucket buffers): not model state."""
        return []

    def landing_grad(self, gi: int) -> torch.Tensor:
        """Group gi's summed gradient shard where it lives, before every piece has landed in it (with offload
        on a device with side streams): settle a range (``copies.settle_range``) before reading it."""
        return self.owned_grad(gi)

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        """The sum of squares of ``landing_grad(gi)[lo:hi]``, as (0-dim float64 parts on the compute device,
        a host part): what can be summed on the device is, so the step's norm need not wait for the copies."""
        part = sum_of_squares(self.owned_grad(gi)[lo:hi])
        return ([], float(part)) if part.device.type == "cpu" else ([part], 0.0)


class FullGradients(GradientStore):
    """Full gradient buffers, all-reduced bucket by bucket (stages 0 and 1).

    In the accumulate dtype. When that is the compute dtype the parameters' ``.grad`` are views into them
    and autograd accumulates there; otherwise each fresh gradient is added in, converted, and ``.grad``
    dropped. When the reduce dtype differs from the accumulate dtype, each bucket is summed as a converted
    copy and copied back; as at stage 2, at most ``in_flight`` copies are left in flight when a launch
    returns, so that no rank holds a second whole gradient.
    """

    def __init__(self, groups: list[FlatParamGroup], bucket_numel: int, dtypes: GradDtypes, comm_group=None,
                 in_flight: int = 0, positions=None):
        self.groups = groups
        self.comm_group = comm_group
        self.views = dtypes.accumulate == dtypes.compute  # the parameters' .grad can be views into the buffers
        self.reduce_dtype = dtypes.reduce
        self.converts = dtypes.reduce != dtypes.accumulate  # buckets are summed as converted copies
        self.in_flight_limit = max(0, int(in_flight))  # converted copies left in flight when a launch returns
        self.flat_grads = [torch.zeros(g.flat.shape, dtype=dtypes.accumulate, device=g.flat.device)
                           for g in groups]  # [padded] accumulate dtype per group
        self.queues = [BucketQueue(g, bucket_numel) for g in groups]
        # (not recording: the full buffers exist anyway, a better launch order would save no memory here)
        self.sequence = LaunchSequence(self.queues, positions, recording=False)
        self.works: deque = deque()  # (work, bucket piece, its converted copy or None) in launch order
        self.sync = True
        self.world = torch.distributed.get_world_size(comm_group)
        self.reduced = False  # the buffers hold a sum over ranks (a synchronised backward ran last)
        self._attach_views()

    def _attach_views(self) -> None:
        for g, buf in zip(self.groups, self.flat_grads):
            for p, span in zip(g.params, g.layout.spans):
                p.grad = buf.narrow(0, span.offset, span.numel).view(span.shape) if self.views else None

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        # Accumulation micro-steps add into the full buffers locally; only the boundary reduces.
        self.sync = boundary and not no_sync
        if self.reduced and self.world > 1:
            # Local gradients are about to be added to a sum over ranks, to be reduced again later: keep
            # the old sum as this rank's 1/W share so that the next reduction counts it once (module doc).
            for buf in self.flat_grads:
                buf.div_(self.world)
        self.reduced = False
        self.unreduced = not self.sync and self.world > 1  # one rank: the local sum is the sum

    def on_grad(self, gi: int, pi: int) -> None:
        g = self.groups[gi]
        p, span = g.params[pi], g.layout.spans[pi]
        view = self.flat_grads[gi].narrow(0, span.offset, span.numel)
        if not self.views:  # the sum is kept in another dtype than autograd's: add this gradient in
            if p.grad is not None:
                view.add_(p.grad.reshape(-1))
            p.grad = None
        elif p.grad is None or p.grad.data_ptr() != view.data_ptr():
            # Someone replaced .grad (e.g. zero_grad(set_to_none=True)): fold it back into the buffer.
            if p.grad is not None:
                view.add_(p.grad.reshape(-1))
            p.grad = view.view(span.shape)
        if self.sync:
            for g, bucket in self.sequence.mark_ready(gi, pi):
                self._launch(g, bucket)

    def _launch(self, gi: int, bucket: Bucket) -> None:
        piece = self.flat_grads[gi][bucket.start:bucket.end]
        if not self.converts:  # summed in place: the full buffers exist anyway, so no limit is needed
            self.works.append((collectives.all_reduce_sum(piece, self.comm_group, async_op=True), piece, None))
            return
        wire = piece.to(self.reduce_dtype)  # [bucket] reduce dtype, on the buffer's device
        self.works.append((collectives.all_reduce_sum(wire, self.comm_group, async_op=True), piece, wire))
        while len(self.works) > self.in_flight_limit:
            self._complete(*self.works.popleft())

    @staticmethod
    def _complete(work, piece: torch.Tensor, wire: Optional[torch.Tensor]) -> None:
        if work is not None:  # (None: done when launched, through shared memory)
            work.wait()
        if wire is not None:
            piece.copy_(wire)

    def end_backward(self) -> None:
        if self.sync:
            self.sequence.finish(self._launch)
        self.drain()
        if self.sync:
            self.reduced, self.unreduced = True, False

    def drain(self) -> None:
        """Wait for every reduction in flight, launching nothing new."""
        while self.works:
            self._complete(*self.works.popleft())

    def owned_grad(self, gi: int) -> torch.Tensor:
        """The summed gradient over group gi's owned range (a view)."""
        lo, hi = self.groups[gi].owned
        return self.flat_grads[gi][lo:hi]

    def zero(self) -> None:
        for buf in self.flat_grads:
            buf.zero_()
        self.reduced = self.unreduced = False
        self._attach_views()

    def tensors(self) -> list[torch.Tensor]:
        return list(self.flat_grads)


class ShardReducer(GradientStore):
    """Shared machinery of the stores that keep only gradient shards (stages 2 and 3).

    Subclasses say how a gradient is copied into its bucket buffer (``_copy_in``),
    how a full bucket is reduced (``_reduce``, returning the pending works and
    anything ``_accumulate`` needs) and how the rank's part is added into its
    shard (``_accumulate``). Buckets launch in order, at most
    ``in_flight`` at a time; every micro-step reduces (no full
    gradient is kept) except under ``no_sync``, where autograd keeps
    accumulating into ``.grad`` until the next synchronised backward.
    """

    def __init__(self, queues: list[BucketQueue], shards: list[torch.Tensor], copies, dtypes: GradDtypes,
                 comm_group=None, in_flight: int = 1, positions=None):
        self.queues = queues
        self.sequence = LaunchSequence(queues, positions)  # one launch order over every group
        self.in_flight_limit = max(0, int(in_flight))  # reductions left running when a launch returns
        self.dtypes = dtypes  # bucket buffers in dtypes.reduce
        self.shards = shards  # [this rank's part] per group: dtypes.shard_dtype, on the host when offloaded
        self.copies = copies  # adds reduced pieces into the shards, wherever they live (offload/copies.py)
        self.comm_group = comm_group
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        # Released bucket storage, reused by the next bucket: a fresh large allocation for every bucket costs
        # page faults on first touch. At most in_flight + 1 of them exist, so still no whole gradient. On the
        # host they are kept for the next backward too (see end_backward). Each with the copies' mark
        # after its download read it (offload: the compute stream waits for that, on the device, before
        # the storage is rewritten; the only point where the compute stream waits for a download; up to
        # DOWNLOAD_BACKLOG_BYTES of them more exist while their downloads run).
        self._free: list[tuple[torch.Tensor, object]] = []
        # Offload on a device with side streams: the sums of squares of the pieces that are their region's
        # whole value, taken on the device (the host copies land later; the step's norm need not wait)
        self.squares: Optional[RegionSquares] = RegionSquares() if copies.defers else None
        self.copied: set[tuple[int, int]] = set()
        self.in_flight: deque = deque()
        self.sync = True
        self._proposal: Optional[list[tuple[int, int]]] = None  # the recorded launch order, until the first step
        self._order_settled = False
        # Buckets whose part of the shard holds nothing since the gradients were zeroed: the first piece is
        # copied in rather than added, so zeroing costs no fill (5 GB of host memory written per step for a
        # 1.3B model with offload); a part still unwritten when the shard is read is zeroed then.
        self._fresh: set[tuple[int, int]] = set()
        if self.squares is not None:  # the shards start zeroed: the first step's pieces are their regions' values
            ShardReducer.zero(self)

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        self.sync = not no_sync
        self.unreduced = self.unreduced or no_sync  # the gradients stay in .grad until a synced backward

    # Offload on a device with side streams: bytes of released bucket buffers whose download may still be
    # reading them that backward may hold before it reuses one (the compute stream then waits for that read,
    # on the device). Below it, backward never waits for the copies to the host: 1 GiB is 10 buckets of the
    # bench_gpu 1.3B model (50M elements, bf16), the downloads it may trail by without slowing backward.
    DOWNLOAD_BACKLOG_BYTES = 1 << 30

    def _new_buffer(self, key: tuple[int, int], shape: tuple, device: torch.device) -> torch.Tensor:
        """A bucket buffer of ``shape`` in the reduce dtype on ``device``, its contents undefined (each gradient
        is copied into its place; ``_zero_unwritten_in`` zeroes the rest at launch), carved from released
        storage when one is big enough (and no download still reads it, below the backlog)."""
        numel = 1
        for n in shape:
            numel *= n
        dtype = self.dtypes.reduce
        i = self._reusable(numel, dtype, device)
        if i is not None:
            store, read = self._free.pop(i)
            if read is not None and not read.query():
                self.copies.before_reuse(read)  # its download still reads it: the device waits, not the host
            buf = store[:numel].view(shape)
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        self.buffers[key] = buf
        return buf

    def _reusable(self, numel: int, dtype: torch.dtype, device: torch.device) -> Optional[int]:
        """The released buffer to carve a bucket from: the first big enough that no download reads any more,
        else, once those still read hold ``DOWNLOAD_BACKLOG_BYTES``, the oldest big enough; None: a new one."""
        fits = [i for i, (store, _) in enumerate(self._free)
                if store.numel() >= numel and store.dtype == dtype and store.device == device]
        for i in fits:
            read = self._free[i][1]
            if read is None or read.query():
                return i
        held = sum(store.numel() * store.element_size() for store, read in self._free if read is not None)
        return fits[0] if fits and held >= self.DOWNLOAD_BACKLOG_BYTES else None

    def _bucket_of(self, gi: int, pi: int) -> Bucket:
        q = self.queues[gi]
        return q.buckets[q.bucket_of[pi]]

    def _grad(self, gi: int, pi: int) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def on_grad(self, gi: int, pi: int) -> None:
        if not self.sync:
            return
        self._take(gi, pi)
        self._launch_ready(gi, pi)

    def _take(self, gi: int, pi: int) -> None:
        """Move parameter pi's fresh gradient into its bucket."""
        self._copy_in(gi, pi)
        self.copied.add((gi, pi))

    def _launch_ready(self, gi: int, pi: int) -> None:
        """Count parameter pi in and launch the buckets that became ready (in sequence, over every group)."""
        for g, bucket in self.sequence.mark_ready(gi, pi):
            self._launch(g, bucket)

    def _launch(self, gi: int, bucket: Bucket) -> None:
        for pi in bucket.params:  # gradients left from no_sync micro-steps and not produced again
            if (gi, pi) not in self.copied and self._grad(gi, pi) is not None:
                self._copy_in(gi, pi)
                self.copied.add((gi, pi))
        buf = self._buffer(gi, bucket)
        self._zero_unwritten_in(gi, bucket, buf, [pi for pi in bucket.params if (gi, pi) in self.copied])
        works, extra = self._reduce(gi, bucket, buf)
        self.in_flight.append((gi, bucket, works, extra))
        while len(self.in_flight) > self.in_flight_limit:
            self._complete(*self.in_flight.popleft())

    def _complete(self, gi: int, bucket: Bucket, works: list, extra) -> None:
        for w in works:
            if w is not None:
                w.wait()
        buf = self.buffers.pop((gi, bucket.index))
        self._accumulate(gi, bucket, buf, extra)
        self._recycle(gi, bucket, buf)

    def _zero_unwritten_in(self, gi: int, bucket: Bucket, buf: torch.Tensor, written: list[int]) -> None:
        """Zero what no gradient was copied into in ``buf`` (``written``: the parameters that were): padding and
        the parameters without a gradient in this backward. Positions run along ``buf``'s last dimension."""
        at = 0  # bucket position up to which the buffer is accounted for
        for lo, hi, pi in sorted(self._place(gi, bucket, pi) + (pi,) for pi in written):
            if lo > at:
                buf[..., at:lo].zero_()
            self._zero_padding(gi, pi, buf[..., lo:hi])
            at = max(at, hi)
        if at < bucket.numel:
            buf[..., at:].zero_()

    def _place(self, gi: int, bucket: Bucket, pi: int) -> tuple[int, int]:
        """Where parameter pi's gradient goes in its bucket's buffer: [lo, hi) along the last dimension."""
        raise NotImplementedError

    def _zero_padding(self, gi: int, pi: int, block: torch.Tensor) -> None:
        """Zero what parameter pi's gradient leaves unwritten of ``block``, its place (none by default)."""

    def _recycle(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> None:
        """Keep a reduced bucket's storage for the next bucket."""
        base = buf._base if buf._base is not None else buf
        self._free.append((base.view(-1), self.copies.reuse_marker()))

    def end_backward(self) -> None:
        if self.sync:
            self.sequence.finish(self._launch)
            self.copied.clear()
            self.unreduced = False
        # The reductions only: the copies to the host go on landing (offload/copies.py), and whoever reads
        # the shards settles them (owned_grad, or the step range by range: landing_grad).
        self._finish_reductions()
        # On a device the caching allocator keeps freed blocks for the next backward's buckets; the host's returns
        # large blocks to the system, and taking them again faults every page in (21k page faults, 40 ms, per
        # backward of an 84 MB bucket on CPU): there the largest in_flight + 1 released buckets are kept, what a
        # backward in the settled order holds at once (the first backward, in another order, may have held more).
        host = sorted((entry for entry in self._free if entry[0].device.type == "cpu"), key=lambda e: -e[0].numel())
        self._free = host[:self.in_flight_limit + 1]
        if self.sync and not self._order_settled and self._proposal is None:
            self._proposal = self.sequence.recorded_order()  # settled at the boundary step
            self.sequence.recording = False

    def order_digests(self) -> tuple[int, int]:
        """Two 20-bit digests of the launch order this rank proposes (the completion order of its first
        synchronised backward), or (0, 0) when it proposes none. They ride on the boundary step's
        all-reduce (``step_stats.py``), which tells whether every rank proposes the same order."""
        if self._proposal is None:
            return 0, 0
        text = repr(self._proposal).encode()
        return 1 + (zlib.crc32(text) & 0xFFFFF), 1 + (zlib.adler32(text) & 0xFFFFF)

    def settle_order(self, agreed: bool) -> None:
        """At the first boundary step: adopt the proposed order when every rank proposed the same one,
        else keep the index order. Either way the order is fixed from then on, on every rank alike."""
        if self._order_settled:
            return
        self._order_settled = True
        if agreed and self._proposal is not None:
            self.sequence.set_order(self._proposal)
        self.sequence.stop_recording()
        self._proposal = None

    def _finish_reductions(self) -> None:
        while self.in_flight:
            self._complete(*self.in_flight.popleft())

    def drain(self) -> None:
        """Wait for every reduction and copy in flight, launching nothing new."""
        self._finish_reductions()
        self.copies.settle()

    def owned_grad(self, gi: int) -> torch.Tensor:
        """The summed gradient shard of group gi."""
        self.copies.settle()
        return self.landing_grad(gi)

    def landing_grad(self, gi: int) -> torch.Tensor:
        self._zero_unwritten(gi)  # (no copy lands in these: zeroed on the host now)
        return self.shards[gi]

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        shard = self.shards[gi]
        if self.squares is None or (lo, hi) != (0, shard.numel()):
            self.copies.settle_range(shard[lo:hi])
            return [], float(sum_of_squares(shard[lo:hi]))
        device, host = [], 0.0
        for bucket in self.queues[gi].buckets:
            known = self.squares.known.get((gi, bucket.index), 0.0)  # absent: nothing written, zero
            if torch.is_tensor(known):
                device.append(known)
            elif known is None:  # several pieces summed on the host: only the host has the sum
                region = self._region(gi, bucket)
                self.copies.settle_range(region)
                host += float(sum_of_squares(region))
        return device, host

    def zero(self) -> None:
        # Offload: copies still landing (a skipped step read none of them) land before the next backward's
        # first pieces, which land in the shards directly (nothing to wait for after a step: it read them all).
        self.copies.settle()
        self._fresh = {(gi, b.index) for gi, q in enumerate(self.queues) for b in q.buckets
                       if self._region(gi, b) is not None}
        if self.squares is not None:
            self.squares.known.clear()

    def _region(self, gi: int, bucket: Bucket) -> Optional[torch.Tensor]:
        """The part of group gi's shard that ``bucket`` writes (None: none of it is this rank's)."""
        raise NotImplementedError

    def _add(self, gi: int, bucket: Bucket, piece: torch.Tensor) -> None:
        """Add ``piece`` into the bucket's part of the shard (copy it in, the first time since zero())."""
        fresh = (gi, bucket.index) in self._fresh
        self._fresh.discard((gi, bucket.index))
        if self.squares is not None:
            self.squares.note((gi, bucket.index), piece if fresh else None)
        self.copies.accumulate_async(self._region(gi, bucket), piece, overwrite=fresh)  # (reuse: _new_buffer)

    def _zero_unwritten(self, gi: int) -> None:
        if not self._fresh:
            return
        for bucket in self.queues[gi].buckets:
            if (gi, bucket.index) in self._fresh:
                self._fresh.discard((gi, bucket.index))
                self._region(gi, bucket).zero_()

    def tensors(self) -> list[torch.Tensor]:
        return list(self.shards) + list(self.buffers.values())

    def workspace(self) -> list[torch.Tensor]:
        return [store for store, _ in self._free]


class RegionSquares:
    """Sums of squares of the regions of the gradient shards (one per bucket), taken on the device from the
    reduced piece when that piece is the region's whole value (the first since the gradients were zeroed),
    before its copy to the host lands; None once a later piece was added on the host."""

    def __init__(self):
        self.known: dict[tuple[int, int], Optional[torch.Tensor]] = {}  # (group, bucket) -> 0-dim float64 or None

    def note(self, key: tuple[int, int], whole: Optional[torch.Tensor]) -> None:
        """A piece went to region ``key``: ``whole``, its entire value (on the device), or None: added there."""
        self.known[key] = sum_of_squares(whole) if whole is not None else None


class ShardedGradients(ShardReducer):
    """Stage 2: buckets are contiguous flat ranges; each rank keeps the part inside its shard."""

    def __init__(self, groups: list[FlatParamGroup], bucket_numel: int, dtypes: GradDtypes, to_owners: bool,
                 placement, comm_group=None, in_flight: int = 1, positions=None):
        self.groups = groups
        self.to_owners = to_owners  # each owner needs only its part (collectives.reduce_to_owners), or all-reduce
        dtype = dtypes.shard_dtype(placement.cpu_optimizer)
        shards = [placement.empty(g.layout.shard_numel, dtype, g.flat.device) for g in groups]
        super().__init__([BucketQueue(g, bucket_numel) for g in groups], shards, placement.copies, dtypes,
                         comm_group, in_flight, positions)
        for g in groups:
            for p in g.params:
                p.grad = None

    def _grad(self, gi: int, pi: int) -> Optional[torch.Tensor]:
        return self.groups[gi].params[pi].grad

    def _buffer(self, gi: int, bucket: Bucket) -> torch.Tensor:
        key = (gi, bucket.index)
        if key not in self.buffers:
            self._new_buffer(key, (bucket.numel,), self.groups[gi].flat.device)  # [bucket] reduce dtype
        return self.buffers[key]

    def _copy_in(self, gi: int, pi: int) -> None:
        g = self.groups[gi]
        p, bucket = g.params[pi], self._bucket_of(gi, pi)
        lo, hi = self._place(gi, bucket, pi)
        self._buffer(gi, bucket)[lo:hi].copy_(p.grad.reshape(-1))  # (converted to the reduce dtype)
        p.grad = None

    def _place(self, gi: int, bucket: Bucket, pi: int) -> tuple[int, int]:
        span = self.groups[gi].layout.spans[pi]
        return span.offset - bucket.start, span.offset - bucket.start + span.numel

    def _reduce(self, gi: int, bucket: Bucket, buf: torch.Tensor):
        if not self.to_owners:  # reduce_scatter false: every rank sums the whole bucket
            return [collectives.all_reduce_sum(buf, self.comm_group, async_op=True)], None
        pieces = [(owner, lo - bucket.start, hi - bucket.start)
                  for owner, lo, hi in self.groups[gi].layout.owner_ranges((bucket.start, bucket.end))]
        return collectives.reduce_to_owners(buf, pieces, self.groups[gi].rank, self.comm_group), None

    def _region(self, gi: int, bucket: Bucket) -> Optional[torch.Tensor]:
        lo0, hi0 = self.groups[gi].owned
        piece = intersect((bucket.start, bucket.end), (lo0, hi0))
        return self.shards[gi][piece[0] - lo0:piece[1] - lo0] if piece else None

    def _accumulate(self, gi: int, bucket: Bucket, buf: torch.Tensor, extra) -> None:
        lo0, hi0 = self.groups[gi].owned
        piece = intersect((bucket.start, bucket.end), (lo0, hi0))
        if piece:
            lo, hi = piece
            self._add(gi, bucket, buf[lo - bucket.start:hi - bucket.start])
