"""The monitor sections, ``tensorboard``, ``csv_monitor`` and ``wandb``: where rank 0 writes the training events."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import Flag, _Section


class _FileMonitorConfig(_Section):
    """A monitor that rank 0 writes into ``output_path/job_name`` every ``steps_per_print`` steps."""

    enabled: Flag = Field(
        False,
        description="Write the training events (loss, lr, grad norm, samples/s, "
        "memory, breakdown times) on rank 0.",
    )
    output_path: str = Field(
        "", description="Directory in which the job's folder is made; empty: the working directory."
    )
    job_name: str = Field(
        "DeepSpeedJobName",
        description="Folder under output_path that receives the files "
        "(DeepSpeed's default name, so paths match).",
    )


class TensorBoardConfig(_FileMonitorConfig):
    """TensorBoard event files (torch.utils.tensorboard; needs the optional tensorboard package)."""


class CSVMonitorConfig(_FileMonitorConfig):
    """One CSV file per event name, rows of step,value (DeepSpeed's csv_monitor layout)."""


class WandbConfig(_Section):
    """A Weights & Biases run that rank 0 logs the training events to (needs the optional wandb package)."""

    enabled: Flag = Field(False, description="Log the training events to wandb on rank 0.")
    group: Optional[str] = Field(None, description="wandb group, to gather related runs.")
    team: Optional[str] = Field(None, description="wandb team (the run's entity).")
    project: str = Field("deepspeed", description="wandb project (DeepSpeed's default name).")
