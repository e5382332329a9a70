"""What the ZeRO step may ask of the optimizer that steps the flat fp32 master shards.

Any ``torch.optim.Optimizer`` can step the shards: the boundary step only needs ``step()``,
``param_groups`` and ``state``. zengine's own optimizers can do more, and declare it by deriving
from ``ShardOptimizer``:

- ``CPUAdam`` steps ranges of a shard, each with its own step number (``step_runs``: parameters
  that got no gradient are left out, and the others keep torch's per-parameter step counts), and
  writes the updated parameters into their compute-dtype copies in the same pass, saving a pass
  over memory after the step;
- a step may be taken in pieces (``steps_in_pieces``): ``step_pieces`` steps the pieces of the
  shards the optimizer cuts them into (``piece_bounds``) in the order it is given, calling the step's
  ``begin`` and ``end`` around each (the offloaded step overlaps the gradients landing and the
  parameters going up with it, ``offload/step_pipeline.py``);
- ``SwappedAdam`` (NVMe offload) keeps its moments in a swap file, so it must be asked to bring its
  states into memory for checkpoints (``states_in_memory``), report the host buffers it holds, and
  be closed.

``abilities(optimizer)`` gives the step one object with all of these for any optimizer: the
optimizer itself when it derives from ``ShardOptimizer``, else ``PlainAbilities`` (the defaults:
states in ``optimizer.state``, nothing to close).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Mapping, NamedTuple, Optional, Sequence

import torch

Runs = list[tuple[int, int, int]]  # (lo, hi, step number) each: elements [lo, hi) of a flat shard


def clip_runs(runs: Runs, lo: int, hi: int) -> Runs:
    """The parts of ``runs`` inside [lo, hi)."""
    out = []
    for a, b, step in runs:
        a, b = max(a, lo), min(b, hi)
        if a < b:
            out.append((a, b, step))
    return out


class ShardPiece(NamedTuple):
    """Elements [lo, hi) of the flat shard parameter ``param``: what a step in pieces steps at once."""

    param: torch.Tensor
    lo: int
    hi: int


class ShardOptimizer:
    """Optional abilities of a shard optimizer, with the defaults of a plain torch optimizer."""

    writes_params = (
        False  # True: ``step_runs`` can write the compute-dtype parameters while stepping
    )
    steps_runs = False  # True: ``step_runs``; else the ZeRO step hands a torch optimizer views (zero/step_counts.py)
    steps_in_pieces = False  # True: one step may be taken in pieces (``step_pieces``)

    def step_runs(
        self,
        runs: Mapping[torch.Tensor, Runs],
        copy_out: Mapping[torch.Tensor, torch.Tensor],
    ):
        """One step over ``runs[param]``: elements [lo, hi) each at its step number (1 for the first), the
        rest of ``param`` untouched; each updated parameter also into ``copy_out[param]`` (if ``writes_params``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot step ranges")

    def record_steps(self, runs: Mapping[torch.Tensor, Runs]) -> None:
        """After a step taken as ``step_runs`` calls over pieces of ``runs`` (``step_pieces``): the
        bookkeeping one ``step_runs(runs, ...)`` call would leave (the step numbers its state shows)."""
        raise NotImplementedError(f"{type(self).__name__} cannot step in pieces")

    def piece_bounds(self, param: torch.Tensor, size: int) -> list[tuple[int, int]]:
        """The [lo, hi) pieces ``step_pieces`` takes ``param`` in, in offset order: of ``size`` elements
        (the last shorter), unless the optimizer has pieces of its own (NVMe: its swap chunks)."""
        n = param.numel()
        return [(lo, min(lo + size, n)) for lo in range(0, n, size)]

    def step_pieces(
        self,
        pieces: Sequence[ShardPiece],
        runs: Mapping[torch.Tensor, Runs],
        begin: Callable[[ShardPiece], Optional[torch.Tensor]],
        end: Callable[[ShardPiece], None],
    ) -> None:
        """One step over ``runs`` (as ``step_runs``), taken piece by piece in the order of ``pieces``
        (each parameter's ``piece_bounds``, every one once). Per piece: ``begin(piece)`` once its
        gradient may be read (it returns the parameter's copy-out target, whose [lo, hi) the step
        writes, or None), the piece's runs stepped, then ``end(piece)``. Leaves what one
        ``step_runs(runs, ...)`` call would: the default is ``step_runs`` per piece, then
        ``record_steps`` (an optimizer whose arithmetic is per element gives the same bits)."""
        for piece in pieces:
            target = begin(piece)
            piece_runs = {
                p: (clip_runs(r, piece.lo, piece.hi) if p is piece.param else [])
                for p, r in runs.items()
            }
            self.step_runs(piece_runs, {piece.param: target} if target is not None else {})
            end(piece)
        self.record_steps(runs)

    def state_dtype(self, param: torch.Tensor, key: str) -> torch.dtype | None:
        """The dtype ``state[param][key]`` is kept in (a checkpoint's values are cast to it), or
        None for a key this optimizer does not keep (a checkpoint's is dropped)."""
        return param.dtype

    def states_in_memory(self) -> ContextManager:
        """A context inside which every state tensor is in ``optimizer.state`` (for checkpoints)."""
        return contextlib.nullcontext()

    def host_buffers(self) -> list[torch.Tensor]:
        """Host memory held besides ``optimizer.state`` (for the memory breakdown)."""
        return []

    def swap_bytes(self) -> int:
        """Bytes of the swap file its states live in (NVMe offload), 0 without one."""
        return 0

    def close(self) -> None:
        """Release files and threads (the engine's ``destroy``)."""


class PlainAbilities(ShardOptimizer):
    """The abilities of an optimizer that declares none: the defaults."""


def abilities(optimizer: torch.optim.Optimizer) -> ShardOptimizer:
    """``optimizer``'s declared abilities, or the defaults when it declares none."""
    return optimizer if isinstance(optimizer, ShardOptimizer) else PlainAbilities()
