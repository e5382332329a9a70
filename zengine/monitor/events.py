"""The training events the engine reports every ``steps_per_print`` optimizer steps.

Names follow DeepSpeed's monitor (``Train/Samples/train_loss``, ``Train/Samples/lr``,
``Train/Samples/loss_scale`` with fp16, ``Train/Samples/elapsed_time_ms_forward`` ... with
``wall_clock_breakdown``); zengine adds the global gradient norm, samples per second and memory
under the same prefix. The x value of every event is the number of samples trained so far
(``engine.global_samples``), DeepSpeed's axis for these names.

Only rank 0 writes. The loss, lr and loss scale are events of every optimizer step, as in
DeepSpeed; the other events are written at each report (``steps_per_print``). The losses stay on the
device until the report, which reads them back together, so monitoring adds one host read per
report, none to the other steps. The loss is rank 0's own (not averaged over ranks, as in DeepSpeed): the mean of the micro
batch losses of the last accumulation window.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Protocol

import psutil
import torch

from ..log import logger
from .timers import BACKWARD, BREAKDOWN, FORWARD, STEP, Timers, format_breakdown
from .base import Event, Monitor

PREFIX = "Train/Samples/"
TRAIN_LOSS = PREFIX + "train_loss"
LR = PREFIX + "lr"
LOSS_SCALE = PREFIX + "loss_scale"
GRAD_NORM = PREFIX + "global_grad_norm"
SAMPLES_PER_SEC = PREFIX + "samples_per_sec"
HOST_RSS_GB = PREFIX + "host_rss_gb"
MEM_ALLOCATED_GB = PREFIX + "mem_allocated_gb"
MAX_MEM_ALLOCATED_GB = PREFIX + "max_mem_allocated_gb"
ELAPSED = {
    FORWARD: PREFIX + "elapsed_time_ms_forward",
    BACKWARD: PREFIX + "elapsed_time_ms_backward",
    STEP: PREFIX + "elapsed_time_ms_step",
}
"""DeepSpeed's event name for each breakdown timer."""

GB = float(1 << 30)


class ReportSource(Protocol):
    """What a report reads from the engine (``Engine`` has all of it)."""

    global_steps: int
    global_samples: int
    global_rank: int
    device: torch.device
    loss_scale: float

    def get_lr(self) -> List[float]: ...

    def get_global_grad_norm(self) -> Optional[float]: ...


def step_events(
    x: int, loss: Optional[float], lr: float, loss_scale: float, fp16: bool
) -> List[Event]:
    """The events of one optimizer step at x = the samples trained after it."""
    events: List[Event] = [] if loss is None else [(TRAIN_LOSS, loss, x)]
    events.append((LR, lr, x))
    if fp16:  # as in DeepSpeed: the scale means something only with fp16
        events.append((LOSS_SCALE, loss_scale, x))
    return events


def training_events(
    engine: ReportSource,
    *,
    loss: Optional[float],
    samples_per_sec: Optional[float],
    elapsed_ms: Dict[str, float],
    fp16: bool,
    with_step_values: bool = True,
) -> List[Event]:
    """The events of one report, all at x = ``engine.global_samples``; an absent value is left out.
    ``with_step_values=False`` leaves out the per-step ones (loss, lr, loss scale)."""
    x = engine.global_samples
    events: List[Event] = []
    if with_step_values:
        events += step_events(x, loss, float(engine.get_lr()[0]), float(engine.loss_scale), fp16)
    norm = engine.get_global_grad_norm()
    if norm is not None:
        events.append((GRAD_NORM, float(norm), x))
    if samples_per_sec is not None:
        events.append((SAMPLES_PER_SEC, samples_per_sec, x))
    events.extend((name, value, x) for name, value in memory_gb(engine.device).items())
    events.extend((ELAPSED[name], ms, x) for name, ms in elapsed_ms.items() if name in ELAPSED)
    return events


def memory_gb(device: torch.device) -> Dict[str, float]:
    """This process's resident host memory and, on a GPU, the allocator's current and peak bytes, in GiB.

    These are host-side counters: reading them does not wait for the device."""
    out = {HOST_RSS_GB: psutil.Process().memory_info().rss / GB}
    if device.type == "cuda":
        out[MEM_ALLOCATED_GB] = torch.cuda.memory_allocated(device) / GB
        out[MAX_MEM_ALLOCATED_GB] = torch.cuda.max_memory_allocated(device) / GB
    return out


class StepReport:
    """Collects what a report needs between reports, and writes the report.

    The engine calls ``record_loss`` in ``backward``, ``report`` at every ``steps_per_print``
    boundary (on every rank: the timers reset everywhere) and the monitor's ``close`` at the end.
    """

    def __init__(self, monitor: Monitor, timers: Timers, fp16: bool = False):
        self.monitor = monitor
        self.timers = timers
        self.fp16 = fp16
        self._loss_sum: Optional[torch.Tensor] = None  # this accumulation window, on the device
        self._loss_count = 0
        self._last_loss: Optional[torch.Tensor] = None  # the last completed window's mean
        # Steps since the last report: (samples after the step, its loss on the device, lr, loss scale)
        self._steps: List[tuple] = []
        self._since = (time.perf_counter(), 0)  # (time, global_samples) of the last report

    def record_loss(self, loss: torch.Tensor, boundary: bool) -> None:
        """Add a micro batch's loss (``boundary``: it is the last of its accumulation window).

        Nothing is read back to the host here; with no monitor on this rank nothing is done at all."""
        if not self.monitor.enabled:
            return
        value = loss.detach()
        value = (value if value.dim() == 0 else value.mean()).float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1
        if boundary:
            self._last_loss = (
                self._loss_sum if self._loss_count == 1 else self._loss_sum / self._loss_count
            )
            self._loss_sum, self._loss_count = None, 0

    def record_step(self, engine: ReportSource) -> None:
        """After a boundary step: keep its loss (on the device), lr and loss scale for the next report."""
        if not self.monitor.enabled:
            return
        self._steps.append(
            (
                engine.global_samples,
                self._last_loss,
                float(engine.get_lr()[0]),
                float(engine.loss_scale),
            )
        )
        self._last_loss = None

    def report(self, engine: ReportSource) -> List[Event]:
        """Log the breakdown line (``wall_clock_breakdown``) and write the events, on rank 0; return them."""
        now = time.perf_counter()
        then, samples = self._since
        self._since = (now, engine.global_samples)
        elapsed = self.timers.elapsed_ms(BREAKDOWN) if self.timers.enabled else {}
        if engine.global_rank != 0:
            return []
        if elapsed:
            logger.info(format_breakdown(elapsed))
        if not self.monitor.enabled:
            return []
        rate = (engine.global_samples - samples) / (now - then) if now > then else None
        if not self._steps:  # report() called on its own: the values at the report are its one step
            self.record_step(engine)
        kept = [loss for _, loss, _, _ in self._steps if loss is not None]
        values = iter(
            torch.stack(kept).tolist() if kept else []
        )  # the one host read, once per report
        events: List[Event] = []
        for x, loss, lr, scale in self._steps:
            events += step_events(x, None if loss is None else next(values), lr, scale, self.fp16)
        self._steps = []
        events += training_events(
            engine,
            loss=None,
            samples_per_sec=rate,
            elapsed_ms=elapsed,
            fp16=self.fp16,
            with_step_values=False,
        )
        self.monitor.write_events(events)
        return events

    def close(self) -> None:
        """Close the monitor (``engine.destroy``)."""
        self.monitor.close()
