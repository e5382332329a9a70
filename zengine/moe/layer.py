"""``deepspeed.moe.layer.MoE``: refused when built, naming the feature and the way out."""

from __future__ import annotations

from torch import nn


class MoEUnsupportedError(NotImplementedError):
    """A script built DeepSpeed's MoE layer: zengine has no expert parallelism."""


class MoE(nn.Module):
    """DeepSpeed's mixture-of-experts layer. zengine does not implement expert parallelism; building one
    raises ``MoEUnsupportedError`` (every rank builds its model, so every rank says it)."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        raise MoEUnsupportedError(
            "deepspeed.moe.layer.MoE: zengine does not implement mixture-of-experts (expert parallelism). "
            "Run the script with its MoE option off, use a dense model, or an MoE block written in plain torch "
            "(every rank then holds every expert, and ZeRO shards them like any other parameters)"
        )
