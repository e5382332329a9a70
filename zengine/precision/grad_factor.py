"""The gradient factor: what a pass's gradients are multiplied by on the way, and what the boundary
step divides the summed gradients by, in one owner (``GradFactor``).

A gradient is scaled exactly once, by whatever its pass's loss was multiplied by, whatever path it
took to its parameter (engine/backward.py). That multiplier is 1 in fp32 and bf16, where the step
divides by ``gradient_accumulation_steps`` once; with fp16 it is the loss scale over the
accumulation steps for a pass ``engine.backward`` started (DeepSpeed's way, to keep fp16's range:
``loss_carries_accumulation``). The step turns the summed gradients into the mean gradient of the
global batch by multiplying with ``unscale()``: 1 / (data-parallel world x what the window carried).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from .loss_scaler import LossScaler, loss_carries_accumulation


class GradFactor:
    """The loss scale, the accumulation steps, the data-parallel world and what the current
    accumulation window's passes multiplied: the one place the gradient factor is computed."""

    # The factor the loss of the engine.backward pass now running was multiplied by (None: no such
    # pass). Process-wide, because one pass can run through several engines (chained engines): every
    # engine it reaches records the root's factor, not its own.
    _running_pass: Optional[float] = None

    def __init__(
        self,
        scaler: LossScaler,
        loss_carries_accumulation: bool,
        accumulation_steps: int,
        dp_world: int = 1,
    ):
        self.scaler = scaler
        self.loss_carries_accumulation = loss_carries_accumulation  # fp16: each loss divided by gas
        self.accumulation_steps = int(accumulation_steps)  # (set_train_batch_size changes it)
        self.dp_world = dp_world  # every data-parallel rank: the gradient is the mean over these
        # what this window's passes multiplied, times the accumulation steps (None: no pass yet, or
        # a new window): set from the first pass the engine saw (a plain fp16 loss.backward()
        # carries no loss scale)
        self.window_multiplier: Optional[float] = None

    @classmethod
    def for_precision(
        cls, scaler: LossScaler, fp16, accumulation_steps: int, dp_world: int = 1
    ) -> "GradFactor":
        """The factor for an ``FP16Config`` (whether the loss carries the accumulation steps)."""
        return cls(scaler, loss_carries_accumulation(fp16), accumulation_steps, dp_world)

    def loss_factor(self) -> float:
        """engine.backward's loss multiplier: 1 in fp32/bf16; fp16: the loss scale over the
        accumulation steps."""
        if self.loss_carries_accumulation:
            return self.scaler.scale / self.accumulation_steps
        return self.scaler.scale

    def divided_loss_carries(self) -> float:
        """What a pass carries whose loss the caller divided by the accumulation steps already
        (``engine.backward(loss, scale_wrt_gas=False)``), the engine multiplying it by the scale."""
        return self.scaler.scale / self.accumulation_steps

    def window_carries(self, factor: Optional[float]) -> None:
        """The window's gradients carry ``factor`` (None: a new window starts)."""
        self.window_multiplier = None if factor is None else factor * self.accumulation_steps

    def unscale(self) -> float:
        """What the summed gradients are multiplied by to become the mean gradient of the global
        batch: 1 / (data-parallel world x loss scale x accumulation steps). In fp32/bf16 the
        accumulation steps are divided here, once, rather than in each loss, so a gradient counts
        once whichever path it took to its parameter; fp16 divides each loss instead."""
        if self.window_multiplier is not None:  # what this window's passes multiplied
            return 1.0 / (self.dp_world * self.window_multiplier)
        divided_here = 1 if self.loss_carries_accumulation else self.accumulation_steps
        return 1.0 / (self.dp_world * self.scaler.scale * divided_here)

    def held_divisor(self) -> float:
        """What the gradients summed over the ranks are divided by to become what torch would hold
        in ``.grad`` after the window's last backward: the mean gradient of the global batch, times
        the loss scale (fp16: a ``GradScaler``'s ``.grad`` is scaled too; 1 in fp32 / bf16)."""
        return 1.0 / (self.unscale() * self.scaler.scale)

    # -- the pass running now, across engines ---------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def running_pass(factor: float) -> Iterator[None]:
        """Inside: an ``engine.backward`` pass runs whose loss was multiplied by ``factor``."""
        outer, GradFactor._running_pass = GradFactor._running_pass, factor
        try:
            yield
        finally:
            GradFactor._running_pass = outer

    @staticmethod
    def of_running_pass() -> Optional[float]:
        """The factor of the ``engine.backward`` pass running now (None: a plain backward)."""
        return GradFactor._running_pass
