"""Where each reduced gradient bucket's piece lands: this rank's gradient shards (stages 2 and 3).

The reducer (``zero/reducer.py``) hands every reduced piece to a ``GradLanding`` with the bucket it
came from; the landing adds it into the bucket's *region* (the part of the group's shard the bucket
writes, fixed by the bucket layout) and answers the step's reads. Two players:

- ``ShardsInMemory``: shards in device or host memory (``offload_optimizer`` cpu), pieces added
  through the copies (``copies.py``), which on a device with side streams land after backward
  returns (``arrivals.py``); the reads settle what they read.
- ``ShardsInSwap``: ZeRO-Infinity, the pieces go to the optimizer's swap records
  (``state_swap.GradSwap``), added there under accumulation; only the sums of squares written stay
  here, for the global norm.

Zeroing the gradients costs no fill: a region written by no piece since ``zero()`` is *fresh*, its
first piece is copied in rather than added (5 GB of host memory written per step for a 1.3B model
with offload), and a region still fresh when its shard is read is zeroed then.

A shard on a device with a caching allocator is not kept from step to step: it is made when the
window's first piece lands in it (or when it is read) and dropped when the gradients are zeroed, as
FSDP2 sets its gradients to None, so the next forward and the start of backward run without it
(``kept_between_steps``: 4/W bytes a parameter less kept from step to step; a 4-block GPT's stage-3
peak 12.97 -> 11.83 bytes a parameter at W=2, ``bench_device_memory.py``). At stage 3 there each
group is one gradient bucket (``zero/sub_groups.py``), so the shards are made bucket by bucket as
backward goes, not all at the first landing while the activations are held (11.83 -> 10.97).
Host shards stay: pinned offload buffers are costly to make, and the host's allocator would fault a
large block in again at every step.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from ..device import reuses_freed_blocks
from ..ops.grad import sum_of_squares
from .copies import HostCopies
from .state_swap import GradSwap

# [lo, hi) of a group's shard that one bucket writes; None: none of it
Region = Optional[tuple[int, int]]


class GradLanding(Protocol):
    """Where the reduced pieces of group ``gi``'s bucket ``b`` land (see the module doc)."""

    shards: list[torch.Tensor]  # this rank's gradient shard per group (placeholders when swapped)

    def add(self, gi: int, b: int, piece: torch.Tensor) -> None:
        """Add ``piece`` (on any device; device work may rewrite it after the copies' reuse mark)
        into bucket ``b``'s region of group ``gi``'s shard."""
        ...

    def owned_grad(self, gi: int) -> torch.Tensor:
        """Group gi's summed gradient shard, every piece landed."""
        ...

    def landing_grad(self, gi: int) -> torch.Tensor:
        """Group gi's shard before every piece has landed in it (``copies.settle_range`` a range
        first)."""
        ...

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        """The sum of squares of ``landing_grad(gi)[lo:hi]``: (0-dim float64 parts on the device, a
        host part)."""
        ...

    def swapped_sq(self) -> torch.Tensor:
        """The sum of squares of every summed shard as written (0-dim float64)."""
        ...

    def settle(self) -> None:
        """Every piece added so far has landed."""
        ...

    def zero(self) -> None:
        """A new accumulation window: the next piece of each region replaces what it holds."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The shards (model state, for the memory breakdown)."""
        ...


class RegionSquares:
    """Sums of squares of the regions of the gradient shards (one per bucket), taken on the device
    from the reduced piece when that piece is the region's whole value (the first since the
    gradients were zeroed), before its copy to the host lands; None once a later piece was added on
    the host."""

    def __init__(self):
        # (group, bucket) -> 0-dim float64 or None
        self.known: dict[tuple[int, int], Optional[torch.Tensor]] = {}

    def note(self, key: tuple[int, int], whole: Optional[torch.Tensor]) -> None:
        """A piece went to region ``key``: ``whole``, its entire value (on the device), or None:
        added there."""
        self.known[key] = sum_of_squares(whole) if whole is not None else None


def kept_between_steps(shard: torch.Tensor) -> bool:
    """Whether a gradient shard is kept from step to step: in host memory yes, on a device with a
    caching allocator no (module doc)."""
    return not reuses_freed_blocks(shard.device)


class ShardsInMemory:
    """Shards in memory (``shards[gi]``: this rank's part of group gi, on the host when offloaded),
    each bucket's pieces added into its region (``regions[gi][b]``) through ``copies``; a shard on a
    device exists only from the window's first piece to ``zero()`` (module doc)."""

    def __init__(
        self, shards: list[torch.Tensor], regions: Sequence[Sequence[Region]], copies: HostCopies
    ):
        # each shard, or None while a dropped one is not made again (made by _shard, as _specs say)
        self._shards: list[Optional[torch.Tensor]] = list(shards)
        self._specs = [(t.numel(), t.dtype, t.device) for t in shards]
        self._kept = [kept_between_steps(t) for t in shards]
        self.regions = regions
        self.copies = copies  # adds the pieces into the shards, wherever they live
        # Offload on a device with side streams: the sums of squares of the pieces that are their
        # region's whole value, taken on the device (the host copies land later; the step's norm
        # need not wait)
        self.squares: Optional[RegionSquares] = RegionSquares() if copies.defers else None
        # regions that hold nothing since zero() (module doc)
        self._fresh: set[tuple[int, int]] = set()
        # the shards start zeroed: the first step's pieces are their regions' values
        if self.squares is not None:
            self.zero()

    @property
    def shards(self) -> list[torch.Tensor]:
        """Every group's shard (made where dropped)."""
        return [self._shard(gi) for gi in range(len(self._shards))]

    def _shard(self, gi: int) -> torch.Tensor:
        """Group gi's shard, made zeroed if it was dropped (its regions are fresh: their first pieces
        are copied in)."""
        shard = self._shards[gi]
        if shard is None:
            numel, dtype, device = self._specs[gi]
            shard = self._shards[gi] = torch.zeros(numel, dtype=dtype, device=device)
        return shard

    def _region(self, gi: int, b: int) -> torch.Tensor:
        lo, hi = self.regions[gi][b]
        return self._shard(gi)[lo:hi]

    def add(self, gi: int, b: int, piece: torch.Tensor) -> None:
        fresh = (gi, b) in self._fresh
        self._fresh.discard((gi, b))
        if self.squares is not None:
            self.squares.note((gi, b), piece if fresh else None)
        self.copies.accumulate_async(self._region(gi, b), piece, overwrite=fresh)

    def owned_grad(self, gi: int) -> torch.Tensor:
        self.copies.settle()
        return self.landing_grad(gi)

    def landing_grad(self, gi: int) -> torch.Tensor:
        self._zero_unwritten(gi)  # (no copy lands in these: zeroed on the host now)
        return self._shard(gi)

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        shard = self._shard(gi)
        if shard.device.type != "cpu":  # a shard on the device (partial offload): summed there
            return [sum_of_squares(shard[lo:hi])], 0.0
        if self.squares is None or (lo, hi) != (0, shard.numel()):
            self.copies.settle_range(shard[lo:hi])
            return [], float(sum_of_squares(shard[lo:hi]))
        device, host = [], 0.0
        for b, region in enumerate(self.regions[gi]):
            if region is None:
                continue
            known = self.squares.known.get((gi, b), 0.0)  # absent: nothing written, zero
            if torch.is_tensor(known):
                device.append(known)
            elif known is None:  # several pieces summed on the host: only the host has the sum
                view = self._region(gi, b)
                self.copies.settle_range(view)
                host += float(sum_of_squares(view))
        return device, host

    def swapped_sq(self) -> torch.Tensor:
        self.copies.settle()
        total = torch.zeros((), dtype=torch.float64)
        for gi in range(len(self._shards)):
            total += sum_of_squares(self.landing_grad(gi)).to(torch.float64).cpu()
        return total

    def settle(self) -> None:
        self.copies.settle()

    def zero(self) -> None:
        # Copies still landing (a skipped step read none of them) land before the next backward's
        # first pieces, which land in the shards directly (nothing to wait for after a step: it read
        # them all).
        self.copies.settle()
        # dropped; the caller's step has let go of them (sp.grad = None: Stage3/ZeroOptimizer.zero_grad)
        self._shards = [t if kept else None for t, kept in zip(self._shards, self._kept)]
        self._fresh = {
            (gi, b)
            for gi, regions in enumerate(self.regions)
            for b, region in enumerate(regions)
            if region is not None
        }
        if self.squares is not None:
            self.squares.known.clear()

    def _zero_unwritten(self, gi: int) -> None:
        if not self._fresh:
            return
        for b, region in enumerate(self.regions[gi]):
            if (gi, b) in self._fresh:
                self._fresh.discard((gi, b))
                self._region(gi, b).zero_()

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self._shards if t is not None]  # (a dropped shard holds nothing)


class ShardsInSwap:
    """ZeRO-Infinity: each reduced piece goes to the optimizer's swap records (``sink``), added
    there under accumulation; ``shards`` are the placeholders that stand in memory for them
    (``param_swap.on_disk``), ``regions`` as ``ShardsInMemory``'s."""

    def __init__(
        self,
        sink: GradSwap,
        shards: list[torch.Tensor],
        regions: Sequence[Sequence[Region]],
        copies: HostCopies,
    ):
        self.sink = sink
        self.shards = shards
        self.regions = regions
        self.copies = copies
        # (group, bucket) -> sum of squares written
        self.sq: dict[tuple[int, int], torch.Tensor] = {}

    def add(self, gi: int, b: int, piece: torch.Tensor) -> None:
        lo, hi = self.regions[gi][b]
        self.sq[(gi, b)] = self.sink.accumulate(gi, lo, hi, piece)

    def owned_grad(self, gi: int) -> torch.Tensor:
        self.copies.settle()
        return self.sink.read(gi)

    def landing_grad(self, gi: int) -> torch.Tensor:
        return self.shards[gi]

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        return [], float(sum_of_squares(self.shards[gi][lo:hi]))

    def swapped_sq(self) -> torch.Tensor:
        if not self.sq:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(list(self.sq.values())).sum()

    def settle(self) -> None:
        self.copies.settle()

    def zero(self) -> None:
        self.sink.reset()
        self.sq.clear()

    def tensors(self) -> list[torch.Tensor]:
        return list(self.shards)
