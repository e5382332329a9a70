"""The offloaded optimizer step, piece by piece: gradients landing, CPU-Adam and uploads overlapped.

With the optimizer on the host and a device with side streams (``copies.StreamCopies``), a step that
took the shard whole would wait for every gradient piece to land before CPU-Adam starts, and start the
uploads only after CPU-Adam finished. ``StepPipeline`` splits each group's shard into pieces of
``piece_elements(sub_group_size)`` and, taking them in the order their gradients land:

1. waits on the event of the newest download into that piece only (``copies.settle_range``): the
   pieces whose gradients landed first are stepped while the others are still on their way;
2. lets the caller prepare the gradient piece (scale, clip) and step it (CPU-Adam over the runs that
   fall in it, writing the compute-dtype parameters into pinned staging, ``copies.writable``);
3. sends that piece up on the up stream (``copies.send_piece``) and goes on with the next piece while
   it travels;

and at the end makes the compute stream wait (on the device) for the last upload (``pieces_sent``).
The host waits only in 1 and, in ``writable``, for the upload a step ago that read the same staging
range (long done).

Which elements an optimizer updates, and how, does not depend on the pieces: CPU-Adam's arithmetic is
per element, so a step taken in pieces gives the same bits as one taken whole.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional

import torch

from .copies import HostCopies
from .state_swap import MAX_CHUNK


class Piece(NamedTuple):
    """Elements [lo, hi) of group ``gi``'s shard."""

    gi: int
    lo: int
    hi: int


def piece_elements(sub_group_size: int) -> int:
    """Elements per piece: ``sub_group_size``, at most ``MAX_CHUNK`` (16M: 64 MiB of fp32 gradient, 32 MiB of
    bf16 parameters to upload; small enough that the last piece's CPU-Adam and upload add little after
    the last gradient lands, large enough that the per-piece cost stays far below a piece's work)."""
    return max(1, min(int(sub_group_size), MAX_CHUNK))


def split(numels: list[int], size: int) -> list[Piece]:
    """Each group's [0, numel) in pieces of ``size`` elements (the last of a group shorter)."""
    return [
        Piece(gi, lo, min(lo + size, n)) for gi, n in enumerate(numels) for lo in range(0, n, size)
    ]


def clip_runs(runs: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The parts of ``runs`` ((lo, hi, step number) each) inside [lo, hi)."""
    out = []
    for a, b, step in runs:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((a, b, step))
    return out


class StepPipeline:
    """One step over host gradient shards in pieces, in landing order (module doc)."""

    def __init__(self, copies: HostCopies, size: int):
        self.copies = copies
        self.size = size

    def order(self, grads: list[torch.Tensor]) -> list[Piece]:
        """Every piece, those whose gradients land first first (stable: otherwise group and offset order)."""
        pieces = split([g.numel() for g in grads], self.size)
        return sorted(pieces, key=lambda p: self.copies.arrival(grads[p.gi][p.lo : p.hi]))

    def run(
        self,
        grads: list[torch.Tensor],
        prepare: Callable[[Piece], None],
        step: Callable[[Piece, Optional[torch.Tensor]], None],
        owned: Mapping[int, torch.Tensor],
    ) -> None:
        """Step every piece of ``grads`` (each group's host gradient shard, [numel] fp32).

        ``prepare(piece)`` runs once the piece's gradient has landed; ``step(piece, target)`` updates it,
        writing the compute-dtype parameters into ``target`` (the group's whole copy-out target: the piece
        is its [lo, hi)) for the groups in ``owned`` (gi -> the parameter shard they end up in), None for the
        others (written after the step).
        """
        try:
            for piece in self.order(grads):
                self.copies.settle_range(
                    grads[piece.gi][piece.lo : piece.hi]
                )  # this piece's newest download only
                prepare(piece)
                target = None
                if piece.gi in owned:
                    target = self.copies.writable(piece.gi, owned[piece.gi], piece.lo, piece.hi)
                step(piece, target)
                if target is not None:
                    self.copies.send_piece(*piece)  # travels while the next piece is stepped
        finally:
            self.copies.pieces_sent()
