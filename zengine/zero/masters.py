"""The fp32 masters and their gradients, as the boundary step sees them: the roles.

The optimizer home of the placement (``offload/placement.py``) builds the master store, one of:

- ``offload/masters.MastersInMemory`` (every placement but ZeRO-Infinity): each group's master is a
  tensor where the placement keeps it (on the device, or in host memory);
- ``offload/infinity.SwappedMasters`` (ZeRO-Infinity, ``InfinityPlacement``): the masters and their
  gradients live in the optimizer's swap records; the gradient store writes into them through the
  store's sink.

At each step the store hands ``ZeroOptimizer.step`` a ``MasterGrads``: whole (built from the summed
gradient, scaled in one pass), in pieces (an offloaded step overlapped with the copies: scaled and
clipped piece by piece as the pieces land, ``offload/step_pipeline.py``) or swapped (scaled chunk by
chunk in the swapped step). Their norm, clip, non-finite search and step differ; the step asks,
never which one it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager, Mapping, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from .shard_step import ShardStepper
    from .step_counts import Plan

G = TypeVar("G")


class GradientReader(Protocol):
    """The read side of a gradient store, as a master store uses it (``grads.py``)."""

    def owned_grad(self, gi: int) -> torch.Tensor:
        """Group gi's summed gradient over this rank's shard (everything reduced)."""

    def landing_grad(self, gi: int) -> torch.Tensor:
        """Group gi's summed gradient, without waiting for pieces still landing on the host."""

    def landing_squares(self, gi: int, lo: int, hi: int) -> tuple[list[torch.Tensor], float]:
        """Squares summed over [lo, hi) of group gi's gradient: (on the device, the host's)."""

    def swapped_sq(self) -> torch.Tensor:
        """ZeRO-Infinity: the sum of squares of the gradients written to the swap records."""


class MasterGrads(Protocol):
    """One step's fp32 master gradients."""

    tensors: list[torch.Tensor]  # per group, what the wrapped optimizer's ``.grad`` shows

    def sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's part of the gradient: 0-dim float64, where it is."""

    def clip(self, coef: float) -> None:
        """Multiply the gradients by ``coef`` (now, or where the step applies them)."""

    def nonfinite_search(self) -> list[torch.Tensor]:
        """Each group's gradient, landed, to find the first non-finite element in."""

    def step(
        self, stepper: "ShardStepper", plans: list["Plan"], owned: Mapping[int, torch.Tensor]
    ) -> None:
        """Step the wrapped optimizer on these gradients as ``plans`` say; ``owned``: gi -> the
        compute-dtype parameter shard it writes as it steps (``ShardStepper.copy_out_targets``)."""


class MasterStore(Protocol):
    """Owns the groups' fp32 masters (and the parameters the wrapped optimizer steps over them)."""

    # [owned numel] fp32 per group (no storage when swapped, outside resident)
    masters: list[torch.Tensor]
    shard_params: list[torch.nn.Parameter]  # the flat parameters the wrapped optimizer steps

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer that steps ``shard_params``, as this store needs it (NVMe: swapped)."""

    def gradient_store(self, in_memory: Callable[[], G], into_sink: Callable[..., G]) -> G:
        """The gradient store that goes with these masters: ``in_memory()``, or ``into_sink(sink)``
        where the reduced gradients go to the store's swap records."""

    def master_grads(
        self, grads: GradientReader, unscale: float, steps_in_pieces: bool
    ) -> MasterGrads:
        """This step's master gradients: the summed gradients times ``unscale``; in pieces where the
        wrapped optimizer ``steps_in_pieces`` and the placement's copies allow it."""

    def unreduced(self, grads: GradientReader) -> MasterGrads:
        """Before the gradients are summed over the ranks (only their norm is asked, unused)."""

    def write_params(self, copied: bool) -> None:
        """After the step: the compute-dtype parameters from the masters (unless ``copied``)."""

    def note_params_written(self) -> None:
        """zengine wrote the parameters (after ``write_params`` and their publishing)."""

    def adopt_param_writes(self) -> None:
        """Parameters written in place by others since become the masters' values."""

    def resident(self) -> ContextManager:
        """Inside: ``masters`` hold their values."""

    def grad_buffers(self) -> list[torch.Tensor]:
        """The master gradients it holds between steps (for the memory breakdown)."""
