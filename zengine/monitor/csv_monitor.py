"""``csv_monitor``: one CSV file per event name, as DeepSpeed's CSV monitor lays them out.

An event ``Train/Samples/lr`` goes to ``<output_path>/<job_name>/Train_Samples_lr.csv`` ('/' and
' ' in the name become '_'), whose first row is the header ``step,lr`` (the last component of the
name) and every further row ``<step>,<value>``. Files are appended to, so a resumed run continues
them; unlike DeepSpeed, the header is written only into a new or empty file, not again on resume.
"""

from __future__ import annotations

import csv
import os
from typing import Dict, List

from .base import Event


class CsvMonitor:
    """Writes each event as a row of the CSV file of its name (rank 0 only builds one)."""

    enabled = True

    def __init__(self, output_path: str, job_name: str):
        # DeepSpeed's layout: output_path/job_name; an empty output_path means the working directory.
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._paths: Dict[str, str] = {}

    def path_of(self, name: str) -> str:
        """The file that receives the events called ``name``."""
        if name not in self._paths:
            self._paths[name] = os.path.join(
                self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv"
            )
        return self._paths[name]

    def write_events(self, events: List[Event]) -> None:
        if not self.enabled:
            return
        for name, value, step in events:
            path = self.path_of(name)
            # Open per write (a handful of files per report step): every row is on disk at once,
            # so a crashed run keeps what it logged, and no file handles are held between reports.
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if handle.tell() == 0:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        self.enabled = False
