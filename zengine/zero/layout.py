"""Shard arithmetic: pure functions and value objects, no process group.

A parameter group's trainable parameters are laid end to end in one flat
buffer (in registration order), padded so that the number of shards divides
it. Rank ``r`` owns the contiguous slice ``[r * shard, (r + 1) * shard)``.
Every shard records, for each parameter it overlaps, the parameter's name and
the range of the parameter's flattened elements it holds: that record is all a
checkpoint needs to re-slice the state for another world size or stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter lives in its group's flat buffer."""

    name: str
    shape: tuple
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardRecord:
    """One parameter's piece of one shard: ``param_flat[param_start:param_end]``
    is stored at ``shard[shard_offset : shard_offset + (param_end - param_start)]``."""

    name: str
    shape: tuple
    param_start: int
    param_end: int
    shard_offset: int


def intersect(a: tuple[int, int], b: tuple[int, int]) -> Optional[tuple[int, int]]:
    """The overlap of two half-open ranges, or None when they do not overlap."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def padded_size(numel: int, num_shards: int, align: int = 1) -> int:
    """Smallest size >= numel that ``num_shards * align`` divides (at least one per shard)."""
    unit = num_shards * align
    return max(unit, math.ceil(numel / unit) * unit)


class FlatLayout:
    """The spans of a group's parameters in its flat buffer and how the buffer is sharded.

    ``num_shards`` is the data-parallel world size for stages 1-3, and 1 for
    stage 0 (every rank owns everything).
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple], num_shards: int):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        spans, offset = [], 0
        for name, shape in zip(names, shapes):
            numel = math.prod(shape)
            spans.append(ParamSpan(name, tuple(shape), offset, numel))
            offset += numel
        self.spans: list[ParamSpan] = spans
        self.numel = offset
        self.num_shards = num_shards
        self.padded_numel = padded_size(offset, num_shards)
        self.shard_numel = self.padded_numel // num_shards

    def shard_range(self, shard: int) -> tuple[int, int]:
        """Flat range owned by ``shard``."""
        return shard * self.shard_numel, (shard + 1) * self.shard_numel

    def owner_ranges(self, flat_range: tuple[int, int]) -> list[tuple[int, int, int]]:
        """``(shard, lo, hi)`` for every shard that owns part of ``flat_range``."""
        if self.shard_numel == 0:
            return []
        first = flat_range[0] // self.shard_numel
        last = (flat_range[1] - 1) // self.shard_numel
        out = []
        for shard in range(first, min(last, self.num_shards - 1) + 1):
            piece = intersect(flat_range, self.shard_range(shard))
            if piece:
                out.append((shard, *piece))
        return out

    def shard_records(self, shard: int) -> list[ShardRecord]:
        """The parameter pieces held by ``shard``, in flat order."""
        start, end = self.shard_range(shard)
        records = []
        for span in self.spans:
            piece = intersect((span.offset, span.end), (start, end))
            if piece:
                records.append(
                    ShardRecord(
                        span.name,
                        span.shape,
                        piece[0] - span.offset,
                        piece[1] - span.offset,
                        piece[0] - start,
                    )
                )
        return records


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters, contiguous in the flat buffer, reduced together."""

    index: int
    params: tuple[int, ...]  # indices into the layout's spans
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def gradient_buckets(
    layout: FlatLayout, bucket_numel: int, kinds: Optional[Sequence[Hashable]] = None
) -> list[Bucket]:
    """Group parameters into buckets of about ``bucket_numel`` elements.

    Gradients arrive roughly in reverse registration order during backward, so
    buckets are filled from the last parameter backwards; each bucket is a
    contiguous flat range. A parameter larger than the bucket size gets a
    bucket of its own. The last bucket (lowest offsets) absorbs the padding.
    ``kinds`` (one per span): a bucket holds parameters of one kind only (the
    dtype their gradients cross the ranks in).
    """
    bucket_numel = max(1, int(bucket_numel))
    buckets: list[Bucket] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(layout.spans))):
        numel = layout.spans[i].numel
        new_kind = kinds is not None and current and kinds[i] != kinds[current[-1]]
        if current and (size + numel > bucket_numel or new_kind):
            buckets.append(_make_bucket(layout, len(buckets), current))
            current, size = [], 0
        current.append(i)
        size += numel
    if current:
        buckets.append(_make_bucket(layout, len(buckets), current))
    if buckets:  # the padding tail sits after the last parameter: give it to the first bucket
        first = buckets[0]
        buckets[0] = Bucket(first.index, first.params, first.start, layout.padded_numel)
    return buckets


def _make_bucket(layout: FlatLayout, index: int, params: list[int]) -> Bucket:
    spans = [layout.spans[i] for i in params]
    return Bucket(
        index, tuple(sorted(params)), min(s.offset for s in spans), max(s.end for s in spans)
    )


def chunk_ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    """Split ``[0, total)`` into ranges of at most ``chunk`` elements."""
    chunk = max(1, int(chunk))
    return [(lo, min(lo + chunk, total)) for lo in range(0, total, chunk)]
