"""``build_monitor``: the monitor the config's ``tensorboard``, ``csv_monitor`` and ``wandb`` sections ask for."""

from __future__ import annotations

from typing import Any, List

from .base import Monitor, MonitorMaster, NullMonitor, require
from .csv_monitor import CsvMonitor
from .tensorboard_monitor import TensorBoardMonitor
from .wandb_monitor import WandbMonitor


def build_monitor(config: Any, rank: int) -> Monitor:
    """The fan-out over every enabled monitor on rank 0; a ``NullMonitor`` elsewhere or when none is.

    ``config`` is a ``ZengineConfig`` (its ``tensorboard``, ``csv_monitor`` and ``wandb``
    sections). Every rank checks that the packages of the enabled monitors import, so a missing
    one stops all ranks at ``initialize`` with ``MonitorDependencyError`` naming the package.
    """
    tensorboard, csv_section, wandb = config.tensorboard, config.csv_monitor, config.wandb
    if not (tensorboard.enabled or csv_section.enabled or wandb.enabled):
        return NullMonitor()
    if tensorboard.enabled:
        require("torch.utils.tensorboard", "tensorboard", "tensorboard")
    if wandb.enabled:
        require("wandb", "wandb", "wandb")
    if rank != 0:  # only rank 0 writes, as in DeepSpeed: one file set and one wandb run per job
        return NullMonitor()
    monitors: List[Monitor] = []
    if tensorboard.enabled:
        monitors.append(TensorBoardMonitor(tensorboard.output_path, tensorboard.job_name))
    if csv_section.enabled:
        monitors.append(CsvMonitor(csv_section.output_path, csv_section.job_name))
    if wandb.enabled:
        monitors.append(WandbMonitor(wandb.project, wandb.group, wandb.team))
    return MonitorMaster(monitors)
