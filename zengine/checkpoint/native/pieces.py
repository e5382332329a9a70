"""What a rank holds, in parameter coordinates: the arithmetic that makes checkpoints layout-free.

A checkpoint never records a flat buffer. It records pieces: elements
``[start, end)`` of one parameter's flattened elements. Whatever the stage or
world size, a rank's master (or shard) is a set of such pieces, each at some
``offset`` in the buffer; saving writes the pieces, loading fills each piece
of the new layout from the old pieces that overlap it.

Two group kinds hold trainable parameters: ``FlatParamGroup`` (stages 0-2,
the parameters end to end, this rank owning one flat range) and
``ShardedParamGroup`` (stage 3, rank r holding chunk r of every parameter).
Both give ``master_pieces()`` in buffer coordinates; ``group_pieces`` turns
those into parameter coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...zero.flat_group import FlatParamGroup
from ...zero.layout import FlatLayout, intersect


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of the flattened parameter ``name``, at ``buffer[offset : offset + end - start]``."""

    name: str
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def group_pieces(group) -> list[Piece]:
    """Every piece of ``group``'s master (or shard) on this rank."""
    out = []
    for i, lo, hi in group.master_pieces():
        if isinstance(group, FlatParamGroup):
            span = group.layout.spans[i]
            name, start = span.name, group.owned[0] + lo - span.offset
        else:  # stage 3: chunk ``rank`` of each parameter, at ``offsets[i]`` in the shard
            sp = group.sharded[i]
            name, start = sp.name, sp.rank * sp.chunk + lo - group.offsets[i]
        out.append(Piece(name, start, start + hi - lo, lo))
    return out


def clip(pieces: Sequence[Piece], lo: int, hi: int) -> list[Piece]:
    """The parts of ``pieces`` that lie in buffer range ``[lo, hi)``."""
    out = []
    for p in pieces:
        part = intersect((p.offset, p.offset + p.numel), (lo, hi))
        if part:
            shift = part[0] - p.offset
            out.append(Piece(p.name, p.start + shift, p.start + shift + part[1] - part[0], part[0]))
    return out


def saved_pieces(group, world: int) -> list[Piece]:
    """The pieces this rank writes: ``norm_range`` splits a group among the ranks without overlap (all
    of a shard when sharded, an even share of a replicated stage-0 master), so no piece is written twice."""
    return clip(group_pieces(group), *group.norm_range(world))


def split_pieces(
    names: Sequence[str], shapes: Sequence[tuple], rank: int, world: int
) -> list[Piece]:
    """This rank's even share of replicated tensors laid end to end (``offset`` is into the parameter)."""
    return [
        Piece(r.name, r.param_start, r.param_end, r.param_start)
        for r in FlatLayout(names, shapes, world).shard_records(rank)
    ]


def overlaps(piece: Piece, saved: Sequence[Sequence[int]]):
    """(file, lo, hi, index in piece) for each saved ``(file, start, end)`` overlapping ``piece``:
    elements ``[lo, hi)`` of the saved piece fill ``piece`` from element ``index`` on."""
    for file, start, end in saved:
        part = intersect((piece.start, piece.end), (start, end))
        if part:
            yield file, part[0] - start, part[1] - start, part[0] - piece.start
