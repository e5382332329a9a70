"""Loss scaling for fp16: static, dynamic, and none (fp32/bf16).

Dynamic scaling follows DeepSpeed's rules: on an overflow the step is skipped
and, once ``hysteresis`` overflows have been absorbed, the scale is divided by
two (never below ``min_loss_scale``); after ``loss_scale_window`` steps without
an overflow it is doubled.
"""

from __future__ import annotations

from typing import Any


class LossScaler:
    """A constant scale (1.0 for fp32/bf16, ``fp16.loss_scale`` when static)."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """Called once per boundary step with whether the gradients overflowed."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """A scale that backs off on overflow and grows after a window of clean steps."""

    dynamic = True

    def __init__(
        self,
        initial_scale: float,
        window: int,
        hysteresis: int,
        min_scale: float,
        consecutive_hysteresis: bool = False,
        factor: float = 2.0,
    ):
        super().__init__(initial_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = factor
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


def loss_carries_accumulation(fp16) -> bool:
    """Whether each micro-step's loss is divided by gradient_accumulation_steps (else the step divides the
    summed gradients, once). fp16 keeps DeepSpeed's division at the loss: gradients summed over the
    micro-steps in fp16 would otherwise grow gas-fold toward its range limit (65504) and skip steps. fp32
    and bf16 have the range, and dividing at the step counts every gradient once whatever path it took
    (engine/backward.py)."""
    return bool(fp16.enabled)


def make_loss_scaler(fp16) -> LossScaler:
    """The scaler for an ``FP16Config`` (a constant 1.0 when fp16 is off)."""
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale > 0:
        return LossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        2.0**fp16.initial_scale_power,
        fp16.loss_scale_window,
        fp16.hysteresis,
        fp16.min_loss_scale,
        fp16.consecutive_hysteresis,
    )
