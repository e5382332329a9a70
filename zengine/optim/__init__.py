"""Optimizers and learning-rate schedules built from the config's ``optimizer`` and
``scheduler`` sections, with DeepSpeed's names and meanings. ``optimizer_param_problems`` and
``scheduler_param_problems`` check a section's params without building it (``load_config`` uses
them); ``params`` holds the rules both they and the builders apply."""

from zengine.optim.builder import OPTIMIZER_NAMES, build_optimizer, optimizer_param_problems
from zengine.optim.schedulers import (
    SCHEDULER_NAMES,
    LRRangeTest,
    LRSchedule,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    scheduler_param_problems,
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
    "optimizer_param_problems",
    "scheduler_param_problems",
]
