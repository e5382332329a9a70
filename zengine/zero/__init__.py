"""ZeRO stages: shard arithmetic, flat groups, gradient stores, the stage optimizers, and the
stage-3 helpers of the public API (``zengine.zero.Init``, ``zengine.zero.GatheredParameters``)."""

from .init import GatheredParameters, Init, MiCS_Init
from .stage3.external import register_external_parameter, unregister_external_parameter
from .stage3.param import ZeroParamStatus
from .stages import build_zero_optimizer

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "ZeroParamStatus",
    "build_zero_optimizer",
    "register_external_parameter",
    "unregister_external_parameter",
]
