"""In what order gradient buckets are reduced: one sequence over every param group, the same on
every rank.

Collectives are matched by the order each rank issues them (NCCL's rule and gloo's), so every rank
must launch the bucket reductions in one sequence, whatever order its gradients become ready in.
They become ready in another order on some rank when a parameter gets a gradient there only at the
end of backward or not at all (a branch one rank skips, a module detached on one rank): its bucket
then waits, and with it every bucket after it in the sequence, until the end of backward, where the
rest launch in sequence.

``BucketQueue`` tracks one group's buckets (which parameters each still misses); ``LaunchSequence``
interleaves the groups' buckets into the single order and says which may launch. The order starts as
the buckets' place in the model (reverse registration order of their parameters, how a sequential
model's gradients arrive; ``positions``) and, after the first boundary step, becomes the order in
which the buckets completed in the first synchronised backward if every rank recorded the same one
(checked in the step's all-reduce): a model whose backward runs in another order would otherwise
hold every bucket until the one the sequence waits for completes.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

from .flat_group import FlatParamGroup
from .layout import Bucket, gradient_buckets

Entry = tuple[int, int]  # (group, bucket index)


class BucketQueue:
    """Readiness of one group's buckets; ``order`` is the group's part of the launch sequence (the
    stage-2 store arms buckets ahead along it)."""

    def __init__(self, group: FlatParamGroup, bucket_numel: int, kinds: Optional[Sequence] = None):
        # kinds: per parameter, what a bucket may not mix (the dtype its gradient is reduced in)
        self.buckets = gradient_buckets(group.layout, bucket_numel, kinds)
        self.bucket_of = {}
        for b in self.buckets:
            for i in b.params:
                self.bucket_of[i] = b.index
        self.set_order(list(range(len(self.buckets))))
        self.reset()

    def reset(self) -> None:
        self.missing = [len(b.params) for b in self.buckets]

    def set_order(self, order: list[int]) -> None:
        """This group's buckets in launch order (bucket indices)."""
        self.order = order
        self.position = {b: i for i, b in enumerate(order)}  # bucket index -> place in ``order``

    def after(self, index: Optional[int], k: int) -> Optional[int]:
        """The bucket ``k`` places after bucket ``index`` in launch order (``index`` None: from the
        start)."""
        pos = (self.position[index] + k) if index is not None else k
        return self.order[pos] if pos < len(self.order) else None


class LaunchSequence:
    """The one order, over every group, in which this rank launches bucket reductions (see the
    module doc).

    ``positions[gi][pi]``: parameter pi of group gi's place in the model's registration order (None:
    each group's buckets in turn). ``recording``: note the completion order of the first
    synchronised backward (the stores that keep only shards propose it at the first step; full
    buffers need no better order)."""

    def __init__(
        self,
        queues: list[BucketQueue],
        positions: Optional[Sequence[Sequence[int]]] = None,
        recording: bool = True,
    ):
        self.queues = queues
        self.recording = recording
        self.completed: list[Entry] = []
        self.set_order(self._by_place(positions))
        self.next = 0

    def _by_place(self, positions) -> list[Entry]:
        entries = [(gi, b.index) for gi, q in enumerate(self.queues) for b in q.buckets]
        if positions is None:
            return entries

        # the latest-registered parameter of a bucket first: its gradient arrives first in backward
        # (Python's sort is stable: a group's own bucket order breaks ties)
        def latest(e: Entry) -> int:
            return max(positions[e[0]][pi] for pi in self.queues[e[0]].buckets[e[1]].params)

        return sorted(entries, key=lambda e: -latest(e))

    def set_order(self, order: list[Entry]) -> None:
        self.order = list(order)
        for gi, q in enumerate(self.queues):
            q.set_order([b for g, b in self.order if g == gi])

    def mark_ready(self, gi: int, pi: int) -> list[tuple[int, Bucket]]:
        """Count parameter pi of group gi in; returns the (group, bucket) pairs that may launch now,
        in order."""
        q = self.queues[gi]
        b = q.bucket_of[pi]
        q.missing[b] -= 1
        if self.recording and q.missing[b] == 0:
            self.completed.append((gi, b))
        return self.pop_ready()

    def pop_ready(self, flush: bool = False) -> list[tuple[int, Bucket]]:
        """The buckets next in the sequence whose parameters are all in (``flush``: all of those
        left)."""
        out = []
        while self.next < len(self.order):
            gi, b = self.order[self.next]
            if not flush and self.queues[gi].missing[b]:
                break
            out.append((gi, self.queues[gi].buckets[b]))
            self.next += 1
        return out

    def finish(self, launch) -> None:
        """End of a synchronised backward: ``launch(gi, bucket)`` every bucket not launched yet, in
        order; reset."""
        for gi, bucket in self.pop_ready(flush=True):
            launch(gi, bucket)
        self.next = 0
        for q in self.queues:
            q.reset()

    def recorded_order(self) -> list[Entry]:
        """The completion order seen while recording, then the buckets that never completed."""
        seen = set(self.completed)
        return self.completed + [e for e in self.order if e not in seen]

    def stop_recording(self) -> None:
        self.recording = False
        self.completed = []


class OrderAgreement:
    """The first boundary step's agreement on ``sequence``'s launch order (the stores that keep only
    shards): each rank proposes the completion order of its first synchronised backward, and the
    order is adopted when every rank proposed the same one, else the index order stays; fixed from
    then on either way."""

    def __init__(self, sequence: LaunchSequence):
        self.sequence = sequence
        # the recorded launch order, until the first step
        self.proposal: Optional[list[Entry]] = None
        self.settled = False

    def backward_done(self, synced: bool) -> None:
        """After a backward: the first synchronised one gives this rank's proposal."""
        if synced and not self.settled and self.proposal is None:
            self.proposal = self.sequence.recorded_order()
            self.sequence.recording = False

    def digests(self) -> tuple[int, int]:
        """Two 20-bit digests of the proposed order, or (0, 0) when there is none. They ride on the
        boundary step's all-reduce (``step_stats.py``), which tells whether every rank proposes the
        same order."""
        if self.proposal is None:
            return 0, 0
        text = repr(self.proposal).encode()
        return 1 + (zlib.crc32(text) & 0xFFFFF), 1 + (zlib.adler32(text) & 0xFFFFF)

    def settle(self, agreed: bool) -> None:
        """At the first boundary step: adopt the proposal when ``agreed`` (every rank proposed
        it)."""
        if self.settled:
            return
        self.settled = True
        if agreed and self.proposal is not None:
            self.sequence.set_order(self.proposal)
        self.sequence.stop_recording()
        self.proposal = None


def registration_positions(module, groups) -> list[list[int]]:
    """Per group, each of its parameters' place in ``module.parameters()`` (the registration
    order)."""
    where = {id(p): i for i, p in enumerate(module.parameters())}
    return [[where.get(id(p), 0) for p in g.params] for g in groups]
