"""Monitoring as DeepSpeed's ``tensorboard``, ``csv_monitor`` and ``wandb`` config sections.

    monitor = build_monitor(config, rank)     # engine.monitor: a NullMonitor unless a section is enabled
    monitor.write_events([("Train/Samples/lr", 1e-3, 4096)])
    monitor.close()

``base`` holds the ``Monitor`` protocol, the fan-out (``MonitorMaster``) and the missing-package
error; ``csv_monitor``, ``tensorboard_monitor`` and ``wandb_monitor`` the sinks (tensorboard and
wandb are optional packages, imported only when their section is enabled); ``build`` picks them
from the config; ``events`` is what the engine reports at ``steps_per_print``.
"""

from .base import Event, Monitor, MonitorDependencyError, MonitorMaster, NullMonitor
from .build import build_monitor
from .csv_monitor import CsvMonitor
from .events import StepReport, training_events
from .tensorboard_monitor import TensorBoardMonitor
from .wandb_monitor import WandbMonitor

__all__ = [
    "CsvMonitor",
    "Event",
    "Monitor",
    "MonitorDependencyError",
    "MonitorMaster",
    "NullMonitor",
    "StepReport",
    "TensorBoardMonitor",
    "WandbMonitor",
    "build_monitor",
    "training_events",
]
