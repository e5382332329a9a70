"""A trial's measurements, taken inside the user's training run: the engine's side of the autotuner.

The tuner starts the user's script with a config whose ``autotuning`` section is ``enabled`` with a
``metric_path``. The engine then gives every optimizer step to an :class:`AutotuningProbe`: the steps
after ``start_profile_step`` up to ``end_profile_step`` are timed (the device synchronised at both ends),
and after ``end_profile_step`` every rank's peak memory is collected, rank 0 writes the metrics file
(whole or not at all) and every process ends with status 0, as DeepSpeed's engine ends an autotuning
experiment. The script's own loop never learns of it; the tuner reads the file.

Peak memory is what the budget is about: on a GPU, ``torch.cuda.max_memory_allocated`` over the whole
run, and the host's resident peak beside it; on a CPU, the process's own resident high-water mark
(``VmHWM`` less the file-backed and shared pages, which are the libraries' and the page cache's, shared
by every rank) over the whole run, model building included.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config.autotuning import AutotuningConfig
from ..device.host import resident_bytes

METRICS_VERSION = 1


def own_peak_bytes() -> int:
    """This process's resident high-water mark less its file-backed and shared pages (0 without /proc)."""
    peak = resident_bytes("VmHWM") - resident_bytes("RssFile") - resident_bytes("RssShmem")
    return max(0, peak)


def full_numels(module: torch.nn.Module) -> list[int]:
    """The trained parameters' whole sizes (a stage-3 shard counts as its full parameter)."""
    return [int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad]


def module_numels(module: torch.nn.Module) -> list[list[int]]:
    """The whole sizes of each module's own trained parameters, for modules with several (stage 3
    gathers those through a staging buffer: the estimator counts it)."""
    out = []
    for m in module.modules():
        mine = [
            int(getattr(p, "ds_numel", p.numel()))
            for p in m.parameters(recurse=False)
            if p.requires_grad
        ]
        if len(mine) > 1:
            out.append(mine)
    return out


class NoProbe:
    """What the engine holds outside a trial: nothing to measure."""

    def after_step(self, engine: Any) -> None:
        """Nothing."""


class AutotuningProbe:
    """Times the profile steps of one trial and writes its metrics (see the module doc)."""

    def __init__(self, settings: AutotuningConfig):
        self.settings = settings
        self.started: Optional[float] = None
        self.tokens_per_sample: Optional[int] = None
        self._hook = None

    @classmethod
    def for_config(
        cls, settings: AutotuningConfig, module: torch.nn.Module
    ) -> "AutotuningProbe | NoProbe":
        """A probe watching ``module`` when the config is a trial's (``enabled`` with a
        ``metric_path``), else a NoProbe."""
        if not (settings.enabled and settings.metric_path):
            return NoProbe()
        probe = cls(settings)
        probe.watch(module)
        return probe

    def watch(self, module: torch.nn.Module) -> None:
        """Note the tokens per sample of the first forward: its first integer input of two or more
        dimensions (token ids, batch first), so the report can give tokens/s; none for other inputs."""

        def first_forward(_module, args, kwargs):
            for value in (*args, *kwargs.values()):
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() >= 2
                    and not value.is_floating_point()
                ):
                    self.tokens_per_sample = value[0].numel()
                    break
            self._hook.remove()

        self._hook = module.register_forward_pre_hook(first_forward, with_kwargs=True)

    def after_step(self, engine: Any) -> None:
        """Called after each optimizer step; ends the process after ``end_profile_step``."""
        step = engine.global_steps
        if step == self.settings.start_profile_step:
            _synchronize(engine.device)
            self.started = time.perf_counter()
        elif step >= self.settings.end_profile_step and self.started is not None:
            _synchronize(engine.device)
            seconds = (time.perf_counter() - self.started) / (
                step - self.settings.start_profile_step
            )
            self._finish(engine, seconds)

    def _finish(self, engine: Any, step_seconds: float) -> None:
        metrics = self.metrics(engine, step_seconds)
        if engine.global_rank == 0:
            _write_whole(self.settings.metric_path, metrics)
        if dist.is_initialized():
            dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        # The trial is over: end every rank here, as DeepSpeed's engine does, without running the rest of
        # the script (whose own shutdown could wait on collectives the ended ranks never join).
        os._exit(0)

    def metrics(self, engine: Any, step_seconds: float) -> dict:
        """The trial's figures, the same on every rank (a collective: every rank calls it)."""
        device = engine.device
        mine = [float(own_peak_bytes())]
        if device.type == "cuda":
            mine.append(float(torch.cuda.max_memory_allocated(device)))
        per_rank = _gather(torch.tensor(mine, dtype=torch.float64), device)
        host_peaks = [int(row[0]) for row in per_rank]
        device_peaks = [int(row[1]) for row in per_rank] if device.type == "cuda" else host_peaks
        batch = engine.train_batch_size()
        numels = full_numels(engine.module)
        return {
            "version": METRICS_VERSION,
            "step_seconds": step_seconds,
            "throughput": batch / step_seconds,  # samples per second, DeepSpeed's metric
            "tokens_per_second": batch * self.tokens_per_sample / step_seconds
            if self.tokens_per_sample
            else None,
            "latency": step_seconds,
            "train_batch_size": batch,
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "world_size": engine.world_size,
            "device": device.type,
            "peak_memory": max(device_peaks),
            "peak_memory_per_rank": device_peaks,
            "host_peak_per_rank": host_peaks,
            "num_params": sum(numels),
            "largest_param": max(numels, default=0),
            "param_numels": numels,
            "module_param_numels": module_numels(engine.module),
            "profiled_steps": self.settings.end_profile_step - self.settings.start_profile_step,
        }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather(mine: torch.Tensor, device: torch.device) -> list[list[float]]:
    """Every rank's row (on the engine's device: NCCL takes only CUDA tensors)."""
    if not dist.is_initialized():
        return [mine.tolist()]
    local = mine.to(device)
    rows = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return [row.cpu().tolist() for row in rows]


def _write_whole(path: str, data: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(data, f)
    os.replace(partial, path)
