"""Optimizers and learning-rate schedules built from the config's ``optimizer`` and
``scheduler`` sections, with DeepSpeed's names and meanings."""

from zengine.optim.builder import OPTIMIZER_NAMES, build_optimizer
from zengine.optim.schedulers import (
    SCHEDULER_NAMES,
    LRRangeTest,
    LRSchedule,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "OPTIMIZER_NAMES",
    "SCHEDULER_NAMES",
    "LRRangeTest",
    "LRSchedule",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]
