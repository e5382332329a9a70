"""The mixed-precision sections, ``fp16`` (with loss scaling) and ``bf16``, and the rule that at most one is on;
the dtypes gradients are reduced and accumulated in (``communication_data_type``, ``data_types``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

import torch
from pydantic import BeforeValidator, Field

from .base import Count, Flag, Integer, Number, _Section

# DeepSpeed reads communication_data_type case-insensitively and data_types' keys by its DtypeEnum, which
# also knows torch's names; both spellings land on these three.
_DTYPE_SPELLINGS = {
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype_name(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip().lower()
        return _DTYPE_SPELLINGS.get(text, text)
    return value


DtypeName = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_dtype_name)]
"""A floating dtype by DeepSpeed's name: "fp32", "fp16" or "bf16" (also "float32", "half", "bfloat16"...)."""


class FP16Config(_Section):
    """float16 mixed precision with loss scaling."""

    enabled: Flag = Field(False, description="Compute in float16, keeping fp32 master weights.")
    loss_scale: Number = Field(
        0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling."
    )
    initial_scale_power: Integer = Field(
        16, ge=0, description="Dynamic scaling starts at 2**initial_scale_power."
    )
    loss_scale_window: Count = Field(
        1000, description="Steps without overflow before the dynamic scale doubles."
    )
    hysteresis: Count = Field(
        2, description="Overflows tolerated before the dynamic scale is halved."
    )
    consecutive_hysteresis: Flag = Field(
        False, description="Refill the hysteresis budget after every step without overflow."
    )
    min_loss_scale: Number = Field(
        1.0, gt=0, description="The dynamic scale never drops below this value."
    )

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when fp16 is on and the loss scale adapts to overflows."""
        return self.enabled and self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """The loss scale that dynamic scaling starts from."""
        return float(2**self.initial_scale_power)


CpuMatmul = Literal["auto", "fp32", "native"]
"""Where bf16 matrix multiplies on the CPU run: ``bf16.cpu_matmul``'s values."""


class BF16Config(_Section):
    """bfloat16 mixed precision (no loss scaling needed)."""

    enabled: Flag = Field(False, description="Compute in bfloat16, keeping fp32 master weights.")
    cpu_matmul: CpuMatmul = Field(
        "auto",
        description=(
            "How nn.Linear's matrix multiplies run when the compute device is the CPU (GPU runs are not touched): "
            "\"native\" in torch's bf16 GEMM; \"fp32\" on the bf16 values upcast to fp32, each result rounded to "
            "bf16 (parameters, activations, gradients, communication and swap stay bf16); \"auto\" picks native on "
            "a CPU with bf16 instructions (avx512_bf16, amx_bf16) and fp32 elsewhere, where torch emulates bf16 "
            "at 1/4 to 1/100 of its fp32 rate. zengine-report shows the rates measured on this CPU."
        ),
    )


class DataTypesConfig(_Section):
    """DeepSpeed's ``data_types``: the dtype gradients are summed in across micro-steps, the buffers'
    dtype (``param_dtype`` is only checked against the compute dtype)."""

    grad_accum_dtype: Optional[DtypeName] = Field(
        None,
        description=(
            "The dtype of the gradient sum over micro-steps: the gradient shard at stages 2-3, the full gradient "
            "buffer at stages 0-1. Default (null): fp32 at stages 2-3, the compute dtype at stages 0-1. With "
            "optimizer offload the host shard is fp32 whatever this says, as in DeepSpeed."
        ),
    )
    buffer_dtype: Optional[DtypeName] = Field(
        None,
        description=(
            "The dtype the model's floating buffers are cast to. Default (null): the compute dtype "
            "(DeepSpeed 0.19.8's null keeps the buffers' own dtype; give it here to keep fp32 "
            "buffers, such as rotary inv_freq, under bf16/fp16)."
        ),
    )
    param_dtype: Optional[DtypeName] = Field(
        None,
        description=(
            "DeepSpeed's parameter dtype; accepted only when it names the compute dtype (DeepSpeed requires the "
            "same), as the fp16/bf16 sections choose it."
        ),
    )


def precision_problem(fp16: FP16Config, bf16: BF16Config) -> Optional[str]:
    """The message for fp16 and bf16 both enabled, else None. ``load_config`` also
    calls it when other sections fail, so this problem is never hidden by them."""
    if fp16.enabled and bf16.enabled:
        return "fp16.enabled: fp16 and bf16 are both enabled; enable at most one"
    return None
