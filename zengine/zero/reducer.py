"""The gradient store of the stages that keep only gradient shards (2 and 3): one ``ShardReducer``.

Each gradient is copied into a bucket buffer as soon as autograd produces it and freed; a full
bucket is reduced across ranks and each rank adds only its part into its shard. At most
``in_flight`` buckets are still being reduced while backward goes on (``grads.buckets_in_flight``),
so no rank ever holds the whole gradient: the gradient transient of a step is ``in_flight + 1``
buckets and ``max(1, in_flight)`` reduced outputs. Every micro-step reduces except under
``no_sync``, where autograd keeps accumulating into ``.grad`` until the next synchronised backward.

The reducer is composed of three parts, one per role, chosen by the stage's builder:

- a ``BucketLayout``: which parameters make a bucket, where each gradient goes in the bucket's
  buffer and which part of the reduced bucket is this rank's (``flat_buckets.FlatRanges``: ranges of
  the flat group buffer, stage 2; ``stage3.grads.RankMajor``: ``[world, chunks]`` rows for a
  reduce-scatter, stage 3);
- a ``ReduceCodec``: how a full bucket crosses the ranks (exact all-reduce, reduce to owners or
  reduce-scatter; ZeRO++'s quantized reduce-scatter; MiCS's replication over the shard groups,
  wrapping another codec);
- a ``GradLanding`` (``offload/landing.py``): the shards the pieces are added into, in memory
  (through the offload copies) or in ZeRO-Infinity's swap records.

Buckets launch in one sequence over every group, the same on every rank (``bucket_order.py``), and
their buffers come from a pool (``bucket_buffers.py``), in the reduce dtype (``grad_dtypes.py``; under
``torch_autocast`` each bucket in its parameters' wire dtype, which a bucket does not mix). A
bucket buffer is not zeroed: every gradient is copied into its place, and only what no gradient
wrote (padding, parameters without a gradient) is zeroed when the bucket launches. (Letting autograd
accumulate into a zeroed bucket through ``.grad`` views costs a fill and an add where a copy does:
measured on CPU, W=1, the 21M GPT: 40 ms of a 0.44 s backward.)
"""

from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union

import torch

from ..offload.landing import GradLanding, Region
from .bucket_buffers import BucketBuffers
from .bucket_order import BucketQueue, LaunchSequence, OrderAgreement
from .grads import GradientStore
from .layout import Bucket


class Reduction(NamedTuple):
    """A bucket's reduction under way: its works (None: done when launched) and its output, a tensor
    or a function returning it once the works are done."""

    works: list
    out: Union[torch.Tensor, Callable[[], torch.Tensor]]

    def result(self) -> torch.Tensor:
        """The reduced output (after the works are done)."""
        return self.out() if callable(self.out) else self.out


class ReduceCodec(Protocol):
    """How a full bucket's buffer is reduced across the ranks."""

    def launch(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> Reduction:
        """Start reducing ``buf``, bucket ``bucket`` of group ``gi``; the result is what the bucket
        layout's ``mine`` reads this rank's part from."""
        ...


class ScaledCodec:
    """``ReduceCodec`` around another: each bucket is multiplied, in its own dtype, before and after
    the reduction (``prescale_gradients``, ``gradient_predivide_factor``: ``scaling``, a
    ``grad_dtypes.ReduceScaling``)."""

    def __init__(self, inner: ReduceCodec, scaling):
        self.inner = inner
        self.scaling = scaling

    def launch(self, gi: int, bucket: Bucket, buf: torch.Tensor) -> Reduction:
        self.scaling.scale(buf, self.scaling.before)
        reduction = self.inner.launch(gi, bucket, buf)
        after = self.scaling.after
        if after == 1.0:
            return reduction
        return Reduction(reduction.works, lambda: self.scaling.scale(reduction.result(), after))


def scaled_codec(codec: ReduceCodec, scaling) -> ReduceCodec:
    """``codec``, wrapped in a ``ScaledCodec`` where the reduction takes the mean (``scaling``)."""
    return ScaledCodec(codec, scaling) if scaling.in_reduce else codec


class BucketLayout(Protocol):
    """Which gradients make a bucket, where each goes in the bucket's buffer, and what of the
    reduced bucket is this rank's. Positions in a buffer run along its last dimension."""

    queues: list[BucketQueue]  # per group: its buckets and their readiness

    def grad(self, gi: int, pi: int) -> Optional[torch.Tensor]:
        """The gradient autograd left for parameter pi of group gi (None: none)."""
        ...

    def check(self, gi: int, pi: int) -> None:
        """Raise if parameter pi's fresh gradient cannot be taken."""
        ...

    def copy_in(self, gi: int, pi: int, buffers: BucketBuffers) -> None:
        """Move parameter pi's gradient into its bucket's buffer (from ``buffers``) and drop
        ``.grad``."""
        ...

    def release(self, gi: int, pi: int) -> None:
        """Parameter pi's gradient is taken (or left to accumulate): what only it needed may go."""
        ...

    def buffer(self, gi: int, bucket: Bucket, buffers: BucketBuffers) -> torch.Tensor:
        """The bucket's buffer, from ``buffers`` (made there the first time)."""
        ...

    def place(self, gi: int, bucket: Bucket, pi: int) -> tuple[int, int]:
        """Where parameter pi's gradient goes in its bucket's buffer: [lo, hi) along the last
        dimension."""
        ...

    def zero_padding(self, gi: int, pi: int, block: torch.Tensor) -> None:
        """Zero what parameter pi's gradient leaves unwritten of ``block``, its place."""
        ...

    def regions(self, gi: int) -> list[Region]:
        """Per bucket of group gi, the range of this rank's shard it writes (None: none)."""
        ...

    def mine(self, gi: int, bucket: Bucket, reduced: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's part of the reduced bucket (None: none), the value of its region."""
        ...


class ShardReducer(GradientStore):
    """Gradient shards reduced bucket by bucket during backward (stages 2 and 3; module doc)."""

    def __init__(
        self,
        layout: BucketLayout,
        codec: ReduceCodec,
        landing: GradLanding,
        buffers: BucketBuffers,
        in_flight: int = 1,
        positions: Optional[Sequence[Sequence[int]]] = None,
    ):
        self.layout = layout
        self.codec = codec
        self.landing = landing
        self.buffers = buffers
        self.queues = layout.queues
        self.sequence = LaunchSequence(self.queues, positions)  # one launch order over every group
        self.agreement = OrderAgreement(self.sequence)
        # reductions left running when a launch returns
        self.in_flight_limit = max(0, int(in_flight))
        # (group, parameter) whose gradient is in its bucket
        self.copied: set[tuple[int, int]] = set()
        self.in_flight: deque = deque()  # (group, bucket, Reduction) in launch order
        self.sync = True
        self.unreduced = False

    @property
    def shards(self) -> list[torch.Tensor]:
        """This rank's gradient shard per group (placeholders when they live in a swap file)."""
        return self.landing.shards

    def begin_backward(self, boundary: bool, no_sync: bool) -> None:
        self.sync = not no_sync
        # the gradients stay in .grad until a synced backward
        self.unreduced = self.unreduced or no_sync

    def on_grad(self, gi: int, pi: int) -> None:
        # Stage 3 releases the full parameter before the launch, which may wait for an earlier
        # bucket: so the wait never holds the parameter and its gradient's copy together.
        self.layout.check(gi, pi)
        if self.sync:
            self._take(gi, pi)
        self.layout.release(gi, pi)
        if self.sync:
            for g, bucket in self.sequence.mark_ready(gi, pi):
                self._launch(g, bucket)

    def _take(self, gi: int, pi: int) -> None:
        self.layout.copy_in(gi, pi, self.buffers)
        self.copied.add((gi, pi))

    def _launch(self, gi: int, bucket: Bucket) -> None:
        for pi in bucket.params:  # gradients left from no_sync micro-steps and not produced again
            if (gi, pi) not in self.copied and self.layout.grad(gi, pi) is not None:
                self._take(gi, pi)
        buf = self.layout.buffer(gi, bucket, self.buffers)
        if not self.buffers.adopted((gi, bucket.index)):  # (an adopted gradient is whole)
            written = [pi for pi in bucket.params if (gi, pi) in self.copied]
            self._zero_unwritten(gi, bucket, buf, written)
        # the oldest completes before the next launches, as FSDP2 waits for the last reduce-scatter:
        # at most max(1, in_flight) outputs beside the buckets (on a GPU the wait orders the
        # streams, and the collectives run in launch order anyway)
        while len(self.in_flight) >= max(1, self.in_flight_limit):
            self._complete(*self.in_flight.popleft())
        self.in_flight.append((gi, bucket, self.codec.launch(gi, bucket, buf)))
        while len(self.in_flight) > self.in_flight_limit:
            self._complete(*self.in_flight.popleft())

    def _zero_unwritten(
        self, gi: int, bucket: Bucket, buf: torch.Tensor, written: list[int]
    ) -> None:
        """Zero what no gradient was copied into in ``buf`` (``written``: the parameters that were):
        padding and the parameters without a gradient in this backward."""
        at = 0  # bucket position up to which the buffer is accounted for
        for lo, hi, pi in sorted(self.layout.place(gi, bucket, pi) + (pi,) for pi in written):
            if lo > at:
                buf[..., at:lo].zero_()
            self.layout.zero_padding(gi, pi, buf[..., lo:hi])
            at = max(at, hi)
        if at < bucket.numel:
            buf[..., at:].zero_()

    def _complete(self, gi: int, bucket: Bucket, reduction: Reduction) -> None:
        for w in reduction.works:
            if w is not None:
                w.wait()
        piece = self.layout.mine(gi, bucket, reduction.result())
        if piece is not None:
            # (its buffer's reuse waits for the read: buffers)
            self.landing.add(gi, bucket.index, piece)
        self.buffers.release((gi, bucket.index))

    def end_backward(self) -> None:
        if self.sync:
            self.sequence.finish(self._launch)
            self.copied.clear()
            self.unreduced = False
        # The reductions only: the copies to the host go on landing (offload/copies.py), and whoever
        # reads the shards settles them (owned_grad, or the step range by range: landing_grad).
        self._finish_reductions()
        # (in the settled order a backward holds in_flight + 1 buckets at once; the first may have
        # held more)
        self.buffers.trim(self.in_flight_limit + 1)
        self.agreement.backward_done(self.sync)

    def order_digests(self) -> tuple[int, int]:
        """Digests of the launch order this rank proposes (the completion order of its first
        synchronised backward), or (0, 0): none (``bucket_order.OrderAgreement``)."""
        return self.agreement.digests()

    def settle_order(self, agreed: bool) -> None:
        """At the first boundary step: adopt the proposed order when every rank proposed the same
        one, else keep the index order. Either way the order is fixed from then on, on every rank
        alike."""
        self.agreement.settle(agreed)

    def _finish_reductions(self) -> None:
        while self.in_flight:
            self._complete(*self.in_flight.popleft())

    def drain(self) -> None:
        """Wait for every reduction and copy in flight, launching nothing new."""
        self._finish_reductions()
        self.landing.settle()

    def owned_grad(self, gi: int) -> torch.Tensor:
        """The summed gradient shard of group gi."""
        self._finish_reductions()
        return self.landing.owned_grad(gi)

    def landing_grad(self, gi: int) -> torch.Tensor:
        return self.landing.landing_grad(gi)

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        return self.landing.landing_squares(gi, lo, hi)

    def swapped_sq(self) -> torch.Tensor:
        """The sum of squares of the summed gradient shards (as written to the swap file): 0-dim
        float64."""
        return self.landing.swapped_sq()

    def zero(self) -> None:
        self.landing.zero()

    def tensors(self) -> list[torch.Tensor]:
        return self.landing.tensors() + list(self.buffers.live.values())

    def workspace(self) -> list[torch.Tensor]:
        return self.buffers.workspace()
