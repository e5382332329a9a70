"""What every monitor is: a sink of ``(name, value, step)`` events, and the fan-out over several.

An event is a TensorBoard-style scalar: ``("Train/Samples/lr", 0.001, 4096)`` is the value of
``Train/Samples/lr`` at x = 4096 (the engine's x axis is the number of samples trained, as in
DeepSpeed). Sinks are built by ``build.py``; only rank 0 gets real ones.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import List, Protocol, Sequence, Tuple, runtime_checkable

Event = Tuple[str, float, int]
"""``(name, value, step)``."""


@runtime_checkable
class Monitor(Protocol):
    """A destination for training events (DeepSpeed's ``engine.monitor`` interface)."""

    enabled: bool
    """True when ``write_events`` records anything on this rank."""

    def write_events(self, events: List[Event]) -> None:
        """Record ``events``; each ``(name, value, step)``."""

    def close(self) -> None:
        """Flush and release files or connections; later writes are dropped."""


class NullMonitor:
    """The monitor when none is enabled, and on every rank but 0: writes nothing."""

    enabled = False

    def write_events(self, events: List[Event]) -> None:
        pass

    def close(self) -> None:
        pass


class MonitorMaster:
    """Hands every event to each of several monitors (DeepSpeed's ``MonitorMaster``)."""

    def __init__(self, monitors: Sequence[Monitor]):
        self.monitors = list(monitors)
        self.enabled = bool(self.monitors)

    def write_events(self, events: List[Event]) -> None:
        if not events:
            return
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        # Close every sink even if one fails, then report the first failure.
        error = None
        for monitor in self.monitors:
            try:
                monitor.close()
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        self.monitors = []
        self.enabled = False
        if error is not None:
            raise error


class MonitorDependencyError(ImportError):
    """A monitor section is enabled but the package it writes with is not installed."""


def require(module: str, section: str, package: str) -> ModuleType:
    """Import ``module`` for config ``section``, or raise ``MonitorDependencyError`` saying what to
    install. ``package`` is the pip name. Called on every rank, so that all ranks stop together
    at ``initialize`` rather than rank 0 alone (the others would then wait in a collective)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MonitorDependencyError(
            f'zengine: "{section}": {{"enabled": true}} needs the {package!r} package, which cannot be '
            f"imported here ({error}); install it with `pip install {package}`, or set "
            f'"{section}": {{"enabled": false}}'
        ) from error
