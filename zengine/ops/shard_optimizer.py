"""What the ZeRO step may ask of the optimizer that steps the flat fp32 master shards.

Any ``torch.optim.Optimizer`` can step the shards: the boundary step only needs ``step()``,
``param_groups`` and ``state``. zengine's own optimizers can do more, and declare it by deriving
from ``ShardOptimizer``:

- ``CPUAdam`` writes the updated parameters into their compute-dtype copies in the same pass
  (``step_with_copy``), saving a pass over memory after the step;
- ``SwappedAdam`` (NVMe offload) keeps its moments in a swap file, so it must be told which
  elements to leave unchanged (``keep_unchanged``), be asked to bring its states into memory for
  checkpoints (``states_in_memory``), report the host buffers it holds, and be closed.

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

    writes_params = False  # True: ``step_with_copy`` writes the compute-dtype parameters while stepping

    def step_with_copy(self, copy_out: Mapping[torch.Tensor, torch.Tensor]):
        """One step that also writes each updated parameter into ``copy_out[param]`` (if ``writes_params``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot write parameters while stepping")

    def keep_unchanged(self, param: torch.Tensor, lo: int, hi: int) -> None:
        """This step must leave the states of ``param[lo:hi]`` as they are. States in ``optimizer.state`` are
        saved and restored by the caller; an optimizer that holds states elsewhere keeps them itself."""

    def states_in_memory(self) -> ContextManager:
        """A context inside which every state tensor is in ``optimizer.state`` (for checkpoints)."""
        return contextlib.nullcontext()

    def host_buffers(self) -> list[torch.Tensor]:
        """Host memory held besides ``optimizer.state`` (for the memory breakdown)."""
        return []

    def close(self) -> None:
        """Release files and threads (the engine's ``destroy``)."""


class PlainAbilities(ShardOptimizer):
    """The abilities of an optimizer that declares none: the defaults."""


def abilities(optimizer: torch.optim.Optimizer) -> ShardOptimizer:
    """``optimizer``'s declared abilities, or the defaults when it declares none."""
    return optimizer if isinstance(optimizer, ShardOptimizer) else PlainAbilities()
