"""``tensorboard``: scalars in a TensorBoard event file, through torch's ``SummaryWriter``.

``torch.utils.tensorboard`` needs the separate ``tensorboard`` package, which zengine does not
require; ``build.py`` checks that it imports before building this monitor.
"""

from __future__ import annotations

import os
from typing import List

from .base import Event, require


class TensorBoardMonitor:
    """Writes each event with ``SummaryWriter.add_scalar`` under ``output_path/job_name``."""

    enabled = True

    def __init__(self, output_path: str, job_name: str):
        summary = require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.log_dir = os.path.join(output_path, job_name)  # DeepSpeed's layout
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = summary.SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: List[Event]) -> None:
        if not self.enabled:
            return
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # reports are rare (steps_per_print): make each visible at once

    def close(self) -> None:
        if self.enabled:
            self.enabled = False
            self.writer.close()
