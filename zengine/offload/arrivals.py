"""Gradient pieces on their way down to host memory: ``Arrivals``, what the host still has to see land.

With the optimizer on the host (``offload_optimizer``) and a device with side streams, each reduced
bucket's piece of this rank's gradient shard is copied into pinned host memory on a side stream
(``copies.StreamCopies``) and lands some time later; backward does not wait for it, and neither does
the compute stream. A piece that is the first into its part of the shard since the gradients were
zeroed lands in the shard itself; a later one (gradient accumulation) lands in pinned staging that the
host adds in once it has landed, in launch order, so the sums are the ones an in-order add gives, bit
for bit.

The step reads the shard range by range (``step_pipeline.py``): ``settle_range`` makes one range
current by waiting on the event of the newest copy that writes into it, and nothing else. All the
copies run in launch order on one side stream, so when that one has landed the older ones have too.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Optional

import torch


class _Pending(NamedTuple):
    seq: int  # launch number (1, 2, ...): the step takes pieces in landing order
    landing: object  # copies.Landed: query() / synchronize() on the copy's done event
    staging: Optional[
        torch.Tensor
    ]  # pinned [n] the copy lands in, added into ``region`` by the host; None: direct
    region: torch.Tensor  # [n] slice of the host gradient shard
    overwrite: bool  # the region held nothing yet: copy the staging in rather than add
    start: int  # [start, end) bytes of ``region``, to find the copies into a range
    end: int


def _bytes(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class Arrivals:
    """Copies into host gradient shards that may not have landed, in launch order (one side stream)."""

    def __init__(self):
        self.pending: deque[_Pending] = deque()
        self._seq = 0

    def add(
        self, landing, staging: Optional[torch.Tensor], region: torch.Tensor, overwrite: bool
    ) -> None:
        """One copy queued into ``region`` (directly, or through ``staging`` when that is given)."""
        self._seq += 1
        self.pending.append(
            _Pending(self._seq, landing, staging, region, overwrite, *_bytes(region))
        )

    def poll(self) -> None:
        """Finish the copies that have landed already (the oldest first); never waits."""
        while self.pending and self.pending[0].landing.query():
            self._finish(self.pending.popleft())

    def settle(self) -> None:
        """Every copy so far has landed and been added (waits on the newest one)."""
        if self.pending:
            self._settle_through(len(self.pending) - 1)

    def settle_range(self, view: torch.Tensor) -> None:
        """Every copy so far into (memory overlapping) ``view`` has landed and been added: waits on the
        newest such copy's event only, and not at all when none is pending."""
        index = self._newest(view)
        if index >= 0:
            self._settle_through(index)

    def arrival(self, view: torch.Tensor) -> int:
        """The launch number of the newest copy still pending into ``view``; 0 when none is."""
        index = self._newest(view)
        return self.pending[index].seq if index >= 0 else 0

    def _newest(self, view: torch.Tensor) -> int:
        start, end = _bytes(view)
        for i in range(len(self.pending) - 1, -1, -1):
            p = self.pending[i]
            if p.start < end and start < p.end:
                return i
        return -1

    def _settle_through(self, index: int) -> None:
        # One wait: the copies before it ran earlier on the same stream, so they have landed as well.
        self.pending[index].landing.synchronize()
        for _ in range(index + 1):
            self._finish(self.pending.popleft())

    @staticmethod
    def _finish(p: _Pending) -> None:
        """A landed copy: add its staging into the shard (nothing to do for one that landed in place)."""
        if p.staging is not None:
            if p.overwrite:
                p.region.copy_(p.staging)
            else:
                p.region.add_(p.staging)
