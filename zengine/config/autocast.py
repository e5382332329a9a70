"""DeepSpeed's ``torch_autocast`` section (fp32 parameters and masters, forward under
``torch.autocast``) and the top-level keys that say how gradients are averaged across ranks
(``prescale_gradients``, ``gradient_predivide_factor``), with the checks across sections they need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from pydantic import Field, field_validator

from .base import Flag, _Section
from .precision import DtypeName

if TYPE_CHECKING:  # annotations only
    from .models import ZengineConfig

DEFAULT_LOWER_PRECISION_SAFE_MODULES = (
    "torch.nn.modules.linear.Linear",
    "torch.nn.modules.conv.Conv1d",
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.modules.conv.Conv3d",
)
"""DeepSpeed's default: the module classes whose parameters' gradients cross the ranks in the
autocast dtype (their products run in it under autocast anyway)."""


class TorchAutocastConfig(_Section):
    """Mixed precision by ``torch.autocast``: parameters, gradients and masters stay fp32."""

    enabled: Flag = Field(False, description="Run the forward under torch.autocast.")
    dtype: Optional[DtypeName] = Field(
        None,
        description=(
            "The autocast dtype, fp16 or bf16. Default (null): torch's default for the device "
            "(bf16 on the CPU, fp16 on CUDA), as torch.autocast without a dtype chooses."
        ),
    )
    lower_precision_safe_modules: Optional[List[str]] = Field(
        None,
        description=(
            "Module classes by import path (\"torch.nn.Linear\"): their parameters' gradients are "
            "reduced across ranks in the autocast dtype, every other parameter's in fp32 (stages "
            "1-3; stage 0 reduces every gradient in communication_data_type, default fp32, as "
            "DeepSpeed). Default (null): nn.Linear and nn.Conv1d/2d/3d."
        ),
    )

    @field_validator("dtype")
    @classmethod
    def _half(cls, value: Optional[str]) -> Optional[str]:
        if value == "fp32":
            raise ValueError("fp32 is not an autocast dtype; give fp16 or bf16 (or omit it)")
        return value

    @property
    def safe_modules(self) -> tuple[str, ...]:
        """The import paths of the lower-precision-safe module classes (the default when null)."""
        given = self.lower_precision_safe_modules
        return DEFAULT_LOWER_PRECISION_SAFE_MODULES if given is None else tuple(given)


def autocast_problems(config: ZengineConfig) -> List[str]:
    """The combinations ``torch_autocast`` cannot run with, one message each (empty: none)."""
    if not config.torch_autocast.enabled:
        return []
    problems = []
    for name in ("fp16", "bf16"):
        if getattr(config, name).enabled:
            problems.append(
                f"torch_autocast.enabled: {name} is enabled too; torch_autocast keeps fp32 "
                f"parameters and masters and computes under torch.autocast, {name} computes on "
                f"{name} parameters: enable one of them"
            )
    zero = config.zero_optimization
    if zero.zero_quantized_weights:
        problems.append(
            "torch_autocast.enabled: zero_optimization.zero_quantized_weights is on; DeepSpeed "
            "refuses the two together (quantized gathers of fp32 parameters): turn one off"
        )
    if config.communication_data_type is not None and zero.stage >= 1:
        problems.append(
            "torch_autocast.enabled: communication_data_type is set at stage "
            f"{zero.stage}; under torch_autocast each gradient is reduced in its own dtype "
            "(lower_precision_safe_modules' in the autocast dtype, the rest in fp32), which "
            "DeepSpeed uses in place of communication_data_type: remove the key"
        )
    return problems


def averaging_problems(config: ZengineConfig) -> List[str]:
    """Checks of ``prescale_gradients`` and ``gradient_predivide_factor``."""
    if config.prescale_gradients and config.gradient_predivide_factor != 1.0:
        return [
            "gradient_predivide_factor: prescale_gradients is true, which divides by the world "
            "size before the reduction and ignores the factor (DeepSpeed's rule): set one of them"
        ]
    return []
