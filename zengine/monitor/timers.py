"""Named wall-clock timers for ``wall_clock_breakdown``: how long forward, backward and step take.

    timers = Timers.for_device(enabled=config.wall_clock_breakdown, device=process_rank.device)
    with timers(FORWARD):
        out = module(x)
    ...
    logger.info(format_breakdown(timers.elapsed_ms(BREAKDOWN)))   # time (ms) | fwd: 12.31 | bwd: ...

A disabled ``Timers`` hands out one shared no-op timer, so the engine pays nothing when the
breakdown is off; in particular it never waits for the device. When it is on and the device is a
GPU, every start and stop first synchronizes the device: the host clock would otherwise measure
only how long it took to *queue* the kernels, not to run them.

Times add up over every interval since the last read (DeepSpeed's global timers do the same), so
the line printed at a ``steps_per_print`` boundary covers the steps since the previous one.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, Mapping, Optional, Union

import torch

# DeepSpeed's names for its global timers, so that breakdown lines read the same.
FORWARD = "fwd"
BACKWARD = "bwd"
STEP = "step"
BREAKDOWN = (FORWARD, BACKWARD, STEP)
"""The timers the engine runs, in the order the breakdown line lists them."""

Synchronize = Callable[[], None]


class WallClockTimer:
    """Adds up the wall time of its start/stop intervals; also a context manager timing its block."""

    def __init__(self, name: str, synchronize: Optional[Synchronize] = None):
        self.name = name
        self._synchronize = synchronize
        self._started: Optional[float] = None
        self._total = 0.0  # seconds, completed intervals only

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``stop()``."""
        return self._started is not None

    def start(self) -> None:
        """Begin an interval; starting a running timer restarts its interval (the unfinished one,
        e.g. cut short by an exception, is dropped rather than counted twice)."""
        self._sync()
        self._started = time.perf_counter()

    def stop(self) -> None:
        """End the interval and add it to the total; a stopped timer is left as it is."""
        if self._started is None:
            return
        self._sync()
        self._total += time.perf_counter() - self._started
        self._started = None

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds of the completed intervals since the last reset (DeepSpeed's unit)."""
        total = self._total * 1000.0
        if reset:
            self._total = 0.0
        return total

    def __enter__(self) -> "WallClockTimer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _sync(self) -> None:
        if self._synchronize is not None:
            self._synchronize()


class _OffTimer:
    """The timer a disabled ``Timers`` hands out: every method does nothing."""

    name = ""
    running = False

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0

    def __enter__(self) -> "_OffTimer":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


_OFF = _OffTimer()


class Timers:
    """Named ``WallClockTimer``s, made on first use: ``with timers(name):`` times a block, and
    ``timers(name).start()`` / ``.stop()`` / ``.elapsed()`` work as on DeepSpeed's ``engine.timers``."""

    def __init__(self, enabled: bool = True, synchronize: Optional[Synchronize] = None):
        self.enabled = enabled
        self._synchronize = synchronize
        self._timers: Dict[str, WallClockTimer] = {}

    @classmethod
    def for_device(cls, enabled: bool, device: torch.device) -> "Timers":
        """Timers that synchronize ``device`` before each clock reading when it is a GPU. Nothing
        synchronizes when ``enabled`` is False: then no timer ever starts."""
        if enabled and device.type == "cuda":
            return cls(enabled, lambda: torch.cuda.synchronize(device))
        return cls(enabled, None)

    def __call__(self, name: str) -> Union[WallClockTimer, _OffTimer]:
        """The timer called ``name`` (created stopped on first use); a shared no-op one when disabled."""
        if not self.enabled:
            return _OFF
        if name not in self._timers:
            self._timers[name] = WallClockTimer(name, self._synchronize)
        return self._timers[name]

    def elapsed_ms(self, names: Iterable[str], reset: bool = True) -> Dict[str, float]:
        """Milliseconds of each named timer that has been used, in the order of ``names``."""
        return {name: self._timers[name].elapsed(reset) for name in names if name in self._timers}


def format_breakdown(elapsed_ms: Mapping[str, float]) -> str:
    """The breakdown line in DeepSpeed's layout: ``time (ms) | fwd: 12.31 | bwd: 20.05 | step: 3.40``."""
    return "time (ms)" + "".join(f" | {name}: {ms:.2f}" for name, ms in elapsed_ms.items())
