"""What the ZeRO step may ask of the optimizer that steps the flat fp32 master shards.

Any ``torch.optim.Optimizer`` can step the shards: the boundary step only needs ``step()``,
``param_groups`` and ``state``. zengine's own optimizers can do more, and declare it by deriving
from ``ShardOptimizer``:

- ``CPUAdam`` steps ranges of a shard, each with its own step number (``step_runs``: parameters
  that got no gradient are left out, and the others keep torch's per-parameter step counts), and
  writes the updated parameters into their compute-dtype copies in the same pass, saving a pass
  over memory after the step;
- ``SwappedAdam`` (NVMe offload) keeps its moments in a swap file, so it must be asked to bring its
  states into memory for checkpoints (``states_in_memory``), report the host buffers it holds, and
  be closed.

``abilities(optimizer)`` gives the step one object with all of these for any optimizer: the
optimizer itself when it derives from ``ShardOptimizer``, else ``PlainAbilities`` (the defaults:
states in ``optimizer.state``, nothing to close).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Mapping

import torch


class ShardOptimizer:
    """Optional abilities of a shard optimizer, with the defaults of a plain torch optimizer."""

    writes_params = (
        False  # True: ``step_runs`` can write the compute-dtype parameters while stepping
    )
    steps_runs = False  # True: ``step_runs``; else the ZeRO step hands a torch optimizer views (zero/step_counts.py)
    steps_in_pieces = False  # True: one step may be ``step_runs`` calls over disjoint pieces, then ``record_steps``

    def step_runs(
        self,
        runs: Mapping[torch.Tensor, list[tuple[int, int, int]]],
        copy_out: Mapping[torch.Tensor, torch.Tensor],
    ):
        """One step over ``runs[param]``: elements [lo, hi) each at its step number (1 for the first), the
        rest of ``param`` untouched; each updated parameter also into ``copy_out[param]`` (if ``writes_params``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot step ranges")

    def record_steps(self, runs: Mapping[torch.Tensor, list[tuple[int, int, int]]]) -> None:
        """After a step taken as ``step_runs`` calls over pieces of ``runs`` (if ``steps_in_pieces``): the
        bookkeeping one ``step_runs(runs, ...)`` call would leave (the step numbers its state shows)."""
        raise NotImplementedError(f"{type(self).__name__} cannot step in pieces")

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
