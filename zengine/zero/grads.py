"""Where gradients live and how they are reduced across ranks.

``FullGradients`` (stages 0 and 1): every rank keeps a full flat gradient
buffer, the parameters' ``.grad`` are views into it, and buckets are
all-reduced from gradient hooks as soon as all their parameters are ready,
so communication overlaps the rest of backward. After the reduction the buffers are divided so that
``.grad`` holds what torch would hold there, the mean gradient of the global batch (issue 41: a
script's own ``clip_grad_norm_`` between backward and step reads and scales it); the step's factor
is adjusted by what was divided (``unscale_held``). A second synchronised
backward before the step (``backward(l1); backward(l2)``) first divides the
already summed buffer by the world size, so that its all-reduce adds each
rank's new gradient to the old sum once, not W times (the sum of W equal
copies of sum/W), as DDP's averaging does implicitly.

Stages 2 and 3 keep only gradient shards: one ``ShardReducer`` (``reducer.py``) composed of a bucket
layout, a reduce codec and a landing for the reduced pieces; stage 2's parts are in
``flat_buckets.py``, stage 3's in ``stage3/grads.py``. Every store plays the ``GradientStore`` role
below.

Buckets launch in one sequence over every group, the same on every rank (``bucket_order.py``):
collectives are matched by order, so a bucket waiting for a parameter that this rank did not use
holds back the ones after it until the end of backward.

Bucket buffers are in the reduce dtype (each gradient converted as it is
copied in) and the sums over micro-steps in the accumulate dtype (``grad_dtypes.py``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Protocol

import torch

from ..distributed import collectives
from ..ops.grad import sum_of_squares
from .flat_group import FlatParamGroup
from .grad_dtypes import GradDtypes
from .bucket_order import BucketQueue, LaunchSequence
from .layout import Bucket


def buckets_in_flight(overlap_comm: bool, ranks: int) -> int:
    """Reductions left running while backward goes on. With ``overlap_comm`` two, so that one
    reduction overlaps the next bucket's; without, none, DeepSpeed's meaning: each bucket's
    reduction completes before backward continues (on a GPU that orders the streams; on CPU the rank
    waits), the least memory. Measured on CPU gloo (bench_zero, W=2): stage 2 1.07x DDP without,
    1.06x with one. Over one rank (``ranks``, the data-parallel world) a reduction is done when
    launched: nothing to overlap, so none is left holding its bucket."""
    return 2 if overlap_comm and ranks > 1 else 0


class GradientStore(Protocol):
    """Where gradients live between autograd and the step, and how they are reduced across ranks:
    the role every stage's gradient store plays (the optimizer and master stores call only these).
    The players inherit the defaults: reducing at the step what backwards under ``no_sync`` left
    local, and no bucket launch order to agree on."""

    unreduced: bool  # a backward without reduction (accumulation, no_sync) left local gradients
    # the parameters' .grad are the store's (torch's clipping may read and scale them); else the
    # gradient lives outside .grad and a script's own clipping is refused (user_clipping.py)
    holds_param_grads: bool = False

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        """A backward starts: ``boundary``, the last of an accumulation window; ``no_sync``, not
        reduced."""
        ...

    def on_grad(self, gi: int, pi: int) -> None:
        """Autograd is done with parameter pi of group gi's gradient in this backward: take it."""
        ...

    def end_backward(self) -> None:
        """The backward is over: launch what is left, wait for the reductions (not the host
        copies)."""
        ...

    def drain(self) -> None:
        """Wait for every reduction and copy in flight, launching nothing new."""
        ...

    def owned_grad(self, gi: int) -> torch.Tensor:
        """The summed gradient over group gi's owned range (its shard)."""
        ...

    def zero(self) -> None:
        """Forget the gradients: a new accumulation window."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The gradient memory held now (for the memory breakdown)."""
        ...

    def unscale_held(self, unscale: float) -> float:
        """What the gradients this store holds now are multiplied by to become the mean gradient,
        given ``unscale`` for the raw sum over ranks (``GradFactor.unscale``): the same by default."""
        return unscale

    def reduce_pending(self) -> None:
        """Reduce the gradients that backwards without reduction left local (the last backward
        before the boundary ran under ``no_sync``): the step must see the sum over ranks."""
        if self.unreduced:
            self.begin_backward(True, False)
            self.end_backward()

    def order_digests(self) -> tuple[int, int]:
        """Digests of the bucket launch order this rank proposes; (0, 0): none to agree on."""
        return 0, 0

    def settle_order(self, agreed: bool) -> None:
        """Fix the bucket launch order at the first boundary step (nothing to fix by default)."""

    def workspace(self) -> list[torch.Tensor]:
        """Storage kept for reuse, holding no gradient (released bucket buffers): not model
        state."""
        return []

    def landing_grad(self, gi: int) -> torch.Tensor:
        """Group gi's summed gradient shard where it lives, before every piece has landed in it
        (with offload on a device with side streams): settle a range (``copies.settle_range``)
        before reading it."""
        return self.owned_grad(gi)

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        """The sum of squares of ``landing_grad(gi)[lo:hi]``, as (0-dim float64 parts on the compute
        device, a host part): what can be summed on the device is, so the step's norm need not wait
        for the copies."""
        part = sum_of_squares(self.owned_grad(gi)[lo:hi])
        return ([], float(part)) if part.device.type == "cpu" else ([part], 0.0)


class FullGradients(GradientStore):
    """Full gradient buffers, all-reduced bucket by bucket (stages 0 and 1).

    In the accumulate dtype. When that is the compute dtype the parameters' ``.grad`` are views into
    them and autograd accumulates there; otherwise each fresh gradient is added in, converted, and
    ``.grad`` dropped. When the reduce dtype differs from the accumulate dtype, each bucket is
    summed as a converted copy and copied back; as at stage 2, at most ``in_flight`` copies are left
    in flight when a launch returns, so that no rank holds a second whole gradient.
    """

    def __init__(
        self,
        groups: list[FlatParamGroup],
        bucket_numel: int,
        dtypes: GradDtypes,
        comm_group=None,
        in_flight: int = 0,
        positions=None,
        held_divisor: Optional[Callable[[], float]] = None,
    ):
        self.groups = groups
        # the reduced sum is divided by held_divisor() (GradFactor.held_divisor) to become torch's
        # .grad; None: left as the sum
        self.held_divisor = held_divisor
        self.divided = 1.0  # what the buffers were divided by since they held the raw sum
        self.comm_group = comm_group
        # the parameters' .grad can be views into the buffers
        self.views = dtypes.accumulate == dtypes.compute
        self.holds_param_grads = self.views
        # each parameter's wire dtype (a bucket holds one): where it is not the accumulate dtype the
        # bucket is summed as a converted copy
        self.wires = [dtypes.wires(g.params) for g in groups]
        self.scaling = dtypes.scaling  # where the mean over ranks is taken
        # converted copies left in flight when a launch returns
        self.in_flight_limit = max(0, int(in_flight))
        self.flat_grads = [
            torch.zeros(g.flat.shape, dtype=dtypes.accumulate, device=g.flat.device) for g in groups
        ]  # [padded] accumulate dtype per group
        self.queues = [BucketQueue(g, bucket_numel, w) for g, w in zip(groups, self.wires)]
        # (not recording: the full buffers exist anyway, a better launch order would save no memory
        # here)
        self.sequence = LaunchSequence(self.queues, positions, recording=False)
        # (work, bucket piece, its converted copy or None) in launch order
        self.works: deque = deque()
        self.sync = True
        self.unreduced = False
        self.world = torch.distributed.get_world_size(comm_group)
        self.reduced = False  # the buffers hold a sum over ranks (a synchronised backward ran last)
        self._attach_views()

    def _attach_views(self) -> None:
        for g, buf in zip(self.groups, self.flat_grads):
            for p, span in zip(g.params, g.layout.spans):
                view = buf.narrow(0, span.offset, span.numel).view(span.shape)
                p.grad = view if self.views else None

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        # Accumulation micro-steps add into the full buffers locally; only the boundary reduces.
        self.sync = boundary and not no_sync
        if self.reduced and (self.world > 1 or self.divided != 1.0):
            # Local gradients are about to be added to a sum over ranks, to be reduced again later:
            # keep the old sum as this rank's 1/W share so that the next reduction counts it once
            # (module doc). Divided already by `divided` for .grad: by world / divided more (by
            # 1 / divided where the reduction itself takes the mean: ReduceScaling).
            share = 1 if self.scaling.in_reduce else self.world
            for buf in self.flat_grads:
                buf.mul_(self.divided / share)
            self.divided = 1.0
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
            # Someone replaced .grad (e.g. zero_grad(set_to_none=True)): fold it back into the
            # buffer.
            if p.grad is not None:
                view.add_(p.grad.reshape(-1))
            p.grad = view.view(span.shape)
        if self.sync:
            for g, bucket in self.sequence.mark_ready(gi, pi):
                self._launch(g, bucket)

    def _launch(self, gi: int, bucket: Bucket) -> None:
        piece = self.flat_grads[gi][bucket.start : bucket.end]
        dtype = self.wires[gi][bucket.params[0]] if bucket.params else piece.dtype
        if dtype == piece.dtype:  # summed in place: the full buffers exist anyway, no limit needed
            self.scaling.scale(piece, self.scaling.before)
            work = collectives.all_reduce_sum(piece, self.comm_group, async_op=True)
            self.works.append((work, piece, None))
            return
        wire = piece.to(dtype)  # [bucket] wire dtype, on the buffer's device
        self.scaling.scale(wire, self.scaling.before)
        work = collectives.all_reduce_sum(wire, self.comm_group, async_op=True)
        self.works.append((work, piece, wire))
        while len(self.works) > self.in_flight_limit:
            self._complete(*self.works.popleft())

    def _complete(self, work, piece: torch.Tensor, wire: Optional[torch.Tensor]) -> None:
        if work is not None:  # (None: done when launched, through shared memory)
            work.wait()
        self.scaling.scale(piece if wire is None else wire, self.scaling.after)
        if wire is not None:
            piece.copy_(wire)

    def end_backward(self) -> None:
        if self.sync:
            self.sequence.finish(self._launch)
        self.drain()
        if self.sync:
            self.reduced, self.unreduced = True, False
            self._present()

    def _present(self) -> None:
        """After the reduction: the buffers (and the .grad views into them) hold the mean gradient
        torch would hold, not the sum over ranks; the step multiplies by what is left."""
        divisor = 1.0 if self.held_divisor is None else self.held_divisor()
        if divisor != 1.0:  # (begin_backward left the raw sum: divided is 1 here)
            for buf in self.flat_grads:
                buf.div_(divisor)
            self.divided = divisor

    def unscale_held(self, unscale: float) -> float:
        return unscale * self.divided

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
        self.divided = 1.0
        self.reduced = self.unreduced = False
        self._attach_views()

    def tensors(self) -> list[torch.Tensor]:
        return list(self.flat_grads)
