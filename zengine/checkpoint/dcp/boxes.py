"""Flat ranges and DCP's chunks: pure arithmetic, no process group.

zengine holds a parameter as pieces, elements ``[start, end)`` of its row-major flattening
(native/pieces.py); DCP stores chunks, N-d boxes (``offsets``, ``sizes``). A flat range that does not
start and end on row boundaries is no one box: ``flat_boxes`` cuts it into the few boxes it is made of
(at most two per dimension plus one), each again one contiguous run of flat elements. ``row_span`` is the
other way: the whole rows that cover a flat range, the one box a reader asks DCP for.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class Box(NamedTuple):
    """A chunk of a tensor of some shape: ``offsets`` and ``sizes`` per dimension, and ``flat_start``,
    the row-major index of its first element (its elements are ``numel`` consecutive flat elements)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes that together are exactly flat elements ``[start, end)`` of a tensor of ``shape``, in
    order; each box's elements are consecutive in the flattening."""
    shape = tuple(int(d) for d in shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {shape}")
    if start == end:
        return []
    if not shape:  # a 0-d tensor: its one element
        return [Box((), (), 0)]
    return [Box(o, s, f) for o, s, f in _boxes(shape, start, end)]


def _boxes(shape: tuple[int, ...], start: int, end: int):
    rest = shape[1:]
    row = math.prod(rest)
    zeros = (0,) * len(rest)
    if start % row == 0 and end % row == 0:  # whole rows: one box
        yield (start // row, *zeros), (end // row - start // row, *rest), start
        return
    if start % row:  # the head: part of one row
        r = start // row
        stop = min(end, (r + 1) * row)
        for o, s, f in _boxes(rest, start - r * row, stop - r * row):
            yield (r, *o), (1, *s), r * row + f
        start = stop
    if end // row > start // row:  # whole rows in the middle
        yield (start // row, *zeros), (end // row - start // row, *rest), start
        start = end // row * row
    if start < end:  # the tail: the first part of one row
        r = start // row
        for o, s, f in _boxes(rest, 0, end - r * row):
            yield (r, *o), (1, *s), r * row + f


def row_span(shape: Sequence[int], start: int, end: int) -> Box:
    """The whole rows of a tensor of ``shape`` that hold flat elements ``[start, end)`` (one box)."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return Box((), (), 0)
    row = math.prod(shape[1:])
    if row == 0:
        return Box((0,) * len(shape), (0, *shape[1:]), 0)
    first, last = start // row, -(-end // row)
    return Box((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:]), first * row)
