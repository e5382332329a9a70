"""The offloaded optimizer step, piece by piece: gradients landing, CPU-Adam and uploads overlapped.

With the optimizer on the host and a device with side streams (``copies.StreamCopies``), a step that
took the shard whole would wait for every gradient piece to land before CPU-Adam starts, and start the
uploads only after CPU-Adam finished. ``StepPipeline`` lets the optimizer take the step in its pieces
(``ShardOptimizer.step_pieces`` over its ``piece_bounds``: pieces of ``piece_elements(sub_group_size)``
for CPU-Adam, the swap file's chunks for NVMe offload's ``SwappedAdam``), hands them to it in the order
their gradients land, and around each piece:

1. ``begin``: waits on the event of the newest download into that piece only (``copies.settle_range``):
   the pieces whose gradients landed first are stepped while the others are still on their way; then
   the caller prepares the gradient piece (scale, clip) and the piece of the copy-out target (pinned
   staging, ``copies.writable``) is handed to the optimizer, which steps the runs that fall in the piece
   and writes the compute-dtype parameters there;
2. ``end``: sends that piece up on the up stream (``copies.send_piece``); the optimizer goes on with
   the next piece while it travels (``SwappedAdam``: its moments read ahead from the file meanwhile, one
   swap stream for the whole step); with stage-3 shards on NVMe (``offload_param``) the piece's
   parameters are written to their swap file behind instead (``ParamsOnNVMe.piece_stepped``);

and at the end makes the compute stream wait (on the device) for the last upload (``pieces_sent``).
The host waits only in 1 and, in ``writable``, for the upload a step ago that read the same staging
range (long done).

Which elements an optimizer updates, and how, does not depend on the pieces: Adam's arithmetic is per
element, so a step taken in pieces gives the same bits as one taken whole.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional

import torch

from ..ops.shard_optimizer import Runs, ShardOptimizer, ShardPiece
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


class StepPipeline:
    """One step over host gradient shards in the optimizer's pieces, in landing order (module doc)."""

    def __init__(self, copies: HostCopies, size: int):
        self.copies = copies
        self.size = size  # elements per piece, for an optimizer without pieces of its own

    def order(
        self, optimizer: ShardOptimizer, params: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> list[ShardPiece]:
        """Every piece of ``params`` as ``optimizer`` cuts them, those whose gradients (``grads``, one per
        parameter) land first first (stable: otherwise parameter and offset order)."""
        pieces = [
            (grad, ShardPiece(p, lo, hi))
            for p, grad in zip(params, grads)
            for lo, hi in optimizer.piece_bounds(p, self.size)
        ]
        pieces.sort(key=lambda gp: self.copies.arrival(gp[0][gp[1].lo : gp[1].hi]))
        return [piece for _, piece in pieces]

    def run(
        self,
        optimizer: ShardOptimizer,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        runs: Mapping[torch.Tensor, Runs],
        prepare: Callable[[Piece], None],
        owned: Mapping[int, torch.Tensor],
        stepped: Callable[[Piece], None] = lambda piece: None,
    ) -> None:
        """``optimizer``'s step over ``runs`` in pieces of ``params`` (group gi's flat shard parameter at
        ``params[gi]``, its host gradient ``grads[gi]``, [numel] in the master's dtype).

        ``prepare(piece)`` runs once the piece's gradient has landed, before it is stepped; the
        optimizer writes the compute-dtype parameters into the copy-out target of the groups in
        ``owned`` (gi -> the parameter shard they end up in), piece by piece, each sent up as soon as it
        is written; the other groups' are written after the step. ``stepped(piece)`` runs after each
        piece is stepped (stage-3 shards on NVMe: its parameters are written to their file behind).
        """
        index = {id(p): gi for gi, p in enumerate(params)}

        def begin(piece: ShardPiece) -> Optional[torch.Tensor]:
            gi, lo, hi = index[id(piece.param)], piece.lo, piece.hi
            self.copies.settle_range(grads[gi][lo:hi])  # this piece's newest download only
            prepare(Piece(gi, lo, hi))
            if gi not in owned:
                return None
            return self.copies.writable(gi, owned[gi], lo, hi)

        def end(piece: ShardPiece) -> None:
            gi = index[id(piece.param)]
            if gi in owned:
                self.copies.send_piece(gi, piece.lo, piece.hi)  # travels while the next is stepped
            stepped(Piece(gi, piece.lo, piece.hi))

        try:
            optimizer.step_pieces(self.order(optimizer, params, grads), runs, begin, end)
        finally:
            self.copies.pieces_sent()
