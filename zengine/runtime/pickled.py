"""The DeepSpeed classes that DeepSpeed's checkpoint files pickle, for DeepSpeed's own scripts under
the compatibility mode.

A DeepSpeed checkpoint folder carries DeepSpeed's ``zero_to_fp32.py``, which unpickles the rank files
with ``torch.load(..., weights_only=False)``: the files name three DeepSpeed classes (the loss scaler,
the ZeRO stage enum, a fragment address). With ``ZENGINE_DEEPSPEED_COMPAT=1`` those names resolve here
(``compat.ALIASES``), so the script runs where only zengine is installed. zengine's own readers never
use these: they read DeepSpeed's files through ``checkpoint/deepspeed/files.py``'s stand-ins without
running any pickled code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ZeroStageEnum(int, enum.Enum):
    """``deepspeed.runtime.zero.config.ZeroStageEnum``: the ZeRO stage a checkpoint was saved at,
    compared as an int."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


@dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's class name, as pickled)
    """``deepspeed.utils.tensor_fragment.fragment_address``: where a parameter's piece starts in a flat
    partition, and its length."""

    numel: int
    start: int


class LossScalerBase:
    """A loss scaler as DeepSpeed pickles it: its attributes only (``cur_scale``, ``dynamic`` ...)."""

    @property
    def loss_scale(self) -> float:
        return self.__dict__.get("cur_scale", 1.0)


class LossScaler(LossScalerBase):
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (a static scale)."""


class DynamicLossScaler(LossScalerBase):
    """``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""
