"""The mixed-precision sections, ``fp16`` (with loss scaling) and ``bf16``, and the rule that at most one is on."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import Count, Flag, Integer, Number, _Section


class FP16Config(_Section):
    """float16 mixed precision with loss scaling."""

    enabled: Flag = Field(False, description="Compute in float16, keeping fp32 master weights.")
    loss_scale: Number = Field(0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling.")
    initial_scale_power: Integer = Field(16, ge=0, description="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: Count = Field(1000, description="Steps without overflow before the dynamic scale doubles.")
    hysteresis: Count = Field(2, description="Overflows tolerated before the dynamic scale is halved.")
    consecutive_hysteresis: Flag = Field(False, description="Refill the hysteresis budget after every step "
                                                            "without overflow.")
    min_loss_scale: Number = Field(1.0, gt=0, description="The dynamic scale never drops below this value.")

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is on and the loss scale adapts to overflows."""
        return self.enabled and self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """The loss scale that dynamic scaling starts from."""
        return float(2 ** self.initial_scale_power)


class BF16Config(_Section):
    """bfloat16 mixed precision (no loss scaling needed)."""

    enabled: Flag = Field(False, description="Compute in bfloat16, keeping fp32 master weights.")


def precision_problem(fp16: FP16Config, bf16: BF16Config) -> Optional[str]:
    """The message for fp16 and bf16 both enabled, else None. ``load_config`` also
    calls it when other sections fail, so this problem is never hidden by them."""
    if fp16.enabled and bf16.enabled:
        return "fp16.enabled: fp16 and bf16 are both enabled; enable at most one"
    return None
