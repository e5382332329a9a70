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
    fp16_master_weights_and_grads: Flag = Field(
        False,
        description=(
            "DeepSpeed's key: keep the master weights and their gradients in fp16 instead of fp32 "
            "(ZeRO stages 1-3, Adam/AdamW/CPUAdam); Adam's moments stay fp32 and its arithmetic "
            "fp32 per element, each master rounded to nearest. The loss scale applies as with fp32 "
            "masters: the gradients are unscaled in the step, an overflow skips it. 12 bytes of model "
            "state per parameter (2 parameter + 2 gradient + 8 moments; the fp16 parameter shard is "
            "the master) instead of 16."
        ),
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
    bf16_master_weights_and_grads: Flag = Field(
        False,
        description=(
            "DeepSpeed's key: keep the master weights and their gradients in bf16 instead of fp32 (ZeRO "
            "stages 1-3). The masters are the bf16 parameter shards themselves where they live with the "
            "optimizer; the Adam arithmetic stays fp32 per element."
        ),
    )
    bf16_optimizer_states: Flag = Field(
        False,
        description=(
            "DeepSpeed's key: keep the optimizer states (Adam's moments) in bf16; needs "
            "bf16_master_weights_and_grads. Both together: 8 bytes of model state per parameter "
            "(2 parameter + 2 gradient + 2 + 2 moments) instead of 16, sharded by the stage."
        ),
    )
    master_rounding: MasterRounding = Field(
        "nearest",
        description=(
            "zengine's key: how a bf16 master stores its fp32 update. \"nearest\" (DeepSpeed's): round to "
            "nearest, updates under half a bf16 ulp are lost; \"kahan\": a bf16 compensation buffer keeps "
            "what rounding dropped (2 bytes more per parameter); \"stochastic\": round up with probability "
            "equal to the dropped fraction (unbiased). Needs bf16_master_weights_and_grads and an Adam "
            "optimizer from the config."
        ),
    )


MasterRounding = Literal["nearest", "kahan", "stochastic"]
"""How bf16 master weights take each update: ``bf16.master_rounding``'s values."""


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


def master_precision_problem(fp16: FP16Config, bf16: BF16Config, stage: int) -> Optional[str]:
    """The message for fp16/bf16 master-weight keys that cannot apply (DeepSpeed's rules), else
    None."""
    if fp16.fp16_master_weights_and_grads and not fp16.enabled:
        return (
            "fp16.fp16_master_weights_and_grads: fp16 masters need fp16 compute; set "
            "fp16.enabled true"
        )
    if fp16.fp16_master_weights_and_grads and stage == 0:
        return (
            "fp16.fp16_master_weights_and_grads is a ZeRO optimizer mode (stages 1-3, as in "
            "DeepSpeed); set zero_optimization.stage to 1, 2 or 3"
        )
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        return (
            "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads: bf16 moments over "
            "fp32 masters are not a DeepSpeed mode; enable both"
        )
    if bf16.master_rounding != "nearest" and not bf16.bf16_master_weights_and_grads:
        return (
            f"bf16.master_rounding: {bf16.master_rounding!r} rounds bf16 masters, and the masters are "
            "fp32; enable bf16.bf16_master_weights_and_grads or leave it \"nearest\""
        )
    if bf16.bf16_master_weights_and_grads and not bf16.enabled:
        return (
            "bf16.bf16_master_weights_and_grads: bf16 masters need bf16 compute; set "
            "bf16.enabled true"
        )
    if bf16.bf16_master_weights_and_grads and stage == 0:
        return (
            "bf16.bf16_master_weights_and_grads is a ZeRO optimizer mode (stages 1-3, as in "
            "DeepSpeed); set zero_optimization.stage to 1, 2 or 3"
        )
    return None


def precision_problem(fp16: FP16Config, bf16: BF16Config) -> Optional[str]:
    """The message for fp16 and bf16 both enabled, else None. ``load_config`` also
    calls it when other sections fail, so this problem is never hidden by them."""
    if fp16.enabled and bf16.enabled:
        return "fp16.enabled: fp16 and bf16 are both enabled; enable at most one"
    return None
