"""``wandb``: events logged to a Weights & Biases run (``wandb.init(project, group, entity=team)``)."""

from __future__ import annotations

from typing import Dict, List, Optional

from .base import Event, require


class WandbMonitor:
    """Logs the events of one step as one ``wandb.log(..., step=step)`` call."""

    enabled = True

    def __init__(self, project: str, group: Optional[str] = None, team: Optional[str] = None):
        self._wandb = require("wandb", "wandb", "wandb")
        self.run = self._wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: List[Event]) -> None:
        if not self.enabled:
            return
        # wandb wants steps that never go down: group by step, in the order they first appear.
        by_step: Dict[int, Dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step, values in by_step.items():
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self.enabled:
            self.enabled = False
            self._wandb.finish()
