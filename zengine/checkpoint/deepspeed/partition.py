"""Where DeepSpeed's ZeRO puts each parameter's elements in its per-rank flat tensors: pure arithmetic.

A DeepSpeed checkpoint saves, per data-parallel rank and per flat group, one 1-D fp32 master (and Adam's
moments shaped like it). Nothing in it names the elements; their owners follow from the parameter shapes
(``param_shapes`` in the model states, in flat order), the world size and DeepSpeed's rules, which this
module states as ``Piece`` lists (native/pieces.py: elements ``[start, end)`` of parameter ``name`` at ``offset``
in that rank's flat tensor), so the reader fills any zengine layout from them.

Stages 1 and 2 (``stage_1_and_2.py``, and ``bf16_optimizer.py`` for bf16 stage 1): a group's trained
parameters end to end, each followed by its alignment padding (``param_alignment_paddings``; zero unless
``zero_optimization.parameter_alignment``), the whole padded to a multiple of ``2 * world`` and cut into
``world`` equal partitions. Rank r's partition starts at ``r * partition``; the ZeRO optimizer saves it
without the group padding at its end (``group_paddings[r]`` elements), the bf16 optimizer with it.

Stage 3 (``stage3.py``): each parameter is cut on its own into ``world`` chunks of ``ceil(numel / world)``
elements (the last one padded); rank r's flat tensor of a sub-group is its chunk of every parameter of
that sub-group, in order.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ..errors import CheckpointFileError
from ..native.pieces import Piece


def partition_numel(numels: Sequence[int], paddings: Sequence[int], world: int) -> int:
    """Stages 1-2: the elements of one rank's partition of a group, the trailing group padding included."""
    total = sum(numels) + sum(paddings)
    alignment = 2 * world  # DeepSpeed aligns each partition start to 4 bytes of 16-bit elements
    return math.ceil(total / alignment) * alignment // world


def flat_group_pieces(
    names: Sequence[str],
    numels: Sequence[int],
    paddings: Optional[Sequence[int]],
    rank: int,
    partition: int,
    saved: int,
) -> list[Piece]:
    """Stages 1-2: the pieces of rank ``rank``'s saved partition (``saved`` elements from flat position
    ``rank * partition``), offsets into that partition."""
    paddings = list(paddings) if paddings is not None else [0] * len(names)
    lo, hi = rank * partition, rank * partition + saved
    out, pos = [], 0
    for name, numel, pad in zip(names, numels, paddings):
        start, end = max(lo, pos), min(hi, pos + numel)
        if start < end:
            out.append(Piece(name, start - pos, end - pos, start - lo))
        pos += numel + pad
    return out


def chunk_numel(numel: int, world: int) -> int:
    """Stage 3: the elements of each rank's chunk of a parameter of ``numel`` elements."""
    return math.ceil(numel / world)


def sharded_group_pieces(
    names: Sequence[str], numels: Sequence[int], rank: int, world: int
) -> list[Piece]:
    """Stage 3: the pieces of rank ``rank``'s flat tensor of one sub-group."""
    out, offset = [], 0
    for name, numel in zip(names, numels):
        chunk = chunk_numel(numel, world)
        start, end = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
        if start < end:
            out.append(Piece(name, start, end, offset))
        offset += chunk
    return out


def sharded_group_numel(numels: Sequence[int], world: int) -> int:
    """Stage 3: the elements of each rank's flat tensor of a sub-group."""
    return sum(chunk_numel(n, world) for n in numels)


def check_saved_numel(where: str, group: int, rank: int, expected: int, found: int) -> None:
    """A flat tensor of another size than the rules give: the layout is not the one this reader knows."""
    if expected != found:
        raise CheckpointFileError(
            f"DeepSpeed checkpoint {where}: rank {rank}'s flat group {group} holds {found} "
            f"elements where DeepSpeed's ZeRO layout for the recorded parameter shapes gives "
            f"{expected}; the file is damaged, or was written by a DeepSpeed layout zengine "
            f"does not read (pipeline or tensor parallelism, a custom partitioner)"
        )
