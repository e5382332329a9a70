"""One trial: the user's script started by the launcher with a candidate's config, its outcome read back.

Each trial has a folder under ``exps_dir``: ``ds_config.json`` (the candidate's config, with the
``autotuning`` section set for a trial), ``cmd.txt``, ``stdout.log`` (the launcher's and the ranks'
output) and, when the script reached ``end_profile_step``, ``metrics.json`` (``engine/trial_probe.py``). A trial that
fails is recorded with the reason read from its exit status and its log (out of memory, a crash with its
last error line, a timeout, a script that ended before the profile steps) and the search goes on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .space import Candidate, get_dotted

CONFIG_FLAGS = ("--deepspeed_config", "--zengine_config", "--deepspeed")
OOM_MARKS = (
    "out of memory",
    "OutOfMemoryError",
    "Cannot allocate memory",
    "std::bad_alloc",
    "MemoryError",
)


class ScriptArgsError(ValueError):
    """The script's arguments name no config file for the tuner to replace."""


def config_argument(user_args: Sequence[str]) -> tuple[int, str]:
    """(index of the value, the path) of the config file in the script's arguments: the value of
    ``--deepspeed_config``, ``--zengine_config`` or Hugging Face's ``--deepspeed PATH`` (``=`` forms too)."""
    for i, arg in enumerate(user_args):
        for flag in CONFIG_FLAGS:
            if arg.startswith(flag + "="):
                return i, arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(user_args) and not user_args[i + 1].startswith("-"):
                return i + 1, user_args[i + 1]
    raise ScriptArgsError(
        "zengine --autotuning: the script's arguments name no config file; pass it as "
        "--deepspeed_config PATH (or --zengine_config PATH, or Hugging Face's --deepspeed PATH)"
    )


def with_config(user_args: Sequence[str], path: str) -> list[str]:
    """The script's arguments with the config file replaced by ``path``."""
    index, _ = config_argument(user_args)
    out = list(user_args)
    flag = next((f for f in CONFIG_FLAGS if out[index].startswith(f + "=")), None)
    out[index] = f"{flag}={path}" if flag else path
    return out


def with_mapped_args(user_args: Sequence[str], mappings: Optional[dict], cfg: dict) -> list[str]:
    """``arg_mappings``: each mapped config key's value in the trial passed as the script's own argument."""
    out = list(user_args)
    for key, flag in (mappings or {}).items():
        value = get_dotted(cfg, key)
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = text
                break
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={text}"
                break
        else:
            out += [flag, text]
    return out


HF_MAPPINGS = {  # Hugging Face's TrainingArguments for the batch keys (its Trainer refuses a config
    # whose batch sizes differ from its arguments)
    "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
    "gradient_accumulation_steps": "--gradient_accumulation_steps",
}


def default_mappings(user_args: Sequence[str], given: Optional[dict]) -> Optional[dict]:
    """``arg_mappings`` as given, else Hugging Face's when the script takes
    ``--per_device_train_batch_size`` (a Trainer script: its arguments must agree with the config)."""
    if given is not None:
        return given
    if any(a.split("=", 1)[0] == HF_MAPPINGS["train_micro_batch_size_per_gpu"] for a in user_args):
        return dict(HF_MAPPINGS)
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Trial:
    """A candidate tried (or ruled out): what was predicted, what was measured, how it ended."""

    candidate: Candidate
    predicted_peak: Optional[float] = None
    predicted_seconds: Optional[float] = None
    metrics: Optional[dict] = None
    status: str = "pending"  # ok, over budget, out of memory, crashed, timeout, no metrics
    reason: str = ""
    phase: str = ""  # why the tuner ran it: profile, search, measures its family, near the budget
    wall_seconds: float = 0.0
    folder: str = ""
    config: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def score(self, metric: str) -> float:
        """Higher is better: samples/s for throughput, 1/step seconds for latency."""
        if not self.metrics:
            return 0.0
        return (
            self.metrics["throughput"] if metric == "throughput" else 1.0 / self.metrics["latency"]
        )

    def progress_line(self, number: int, best: bool) -> str:
        """The tuner's line for this trial, the ``number``-th run (``best``: the best so far)."""
        head = f"[autotuning] trial {number} ({self.phase}) {self.candidate.name}: "
        if self.metrics:
            m = self.metrics
            tokens = (
                f", {m['tokens_per_second']:,.0f} tokens/s" if m.get("tokens_per_second") else ""
            )
            pred = f" (predicted {_mib(self.predicted_peak)})" if self.predicted_peak else ""
            text = (
                f"{m['throughput']:.2f} samples/s{tokens}, {m['step_seconds'] * 1e3:.0f} ms/step, "
                f"peak {_mib(m['peak_memory'])} MiB{pred}"
            )
            if not self.ok:
                text += f" - {self.status}"
        else:
            text = f"{self.status}: {self.reason}"
        return head + text + f" [{self.wall_seconds:.0f} s]" + (" - best so far" if best else "")

    def row(self) -> dict[str, Any]:
        m = self.metrics or {}
        return {
            "name": self.candidate.name,
            "status": self.status,
            "reason": self.reason,
            "phase": self.phase,
            "predicted_peak": self.predicted_peak,
            "measured_peak": m.get("peak_memory"),
            "predicted_step_seconds": self.predicted_seconds,
            "step_seconds": m.get("step_seconds"),
            "samples_per_second": m.get("throughput"),
            "tokens_per_second": m.get("tokens_per_second"),
            "wall_seconds": self.wall_seconds,
            "folder": self.folder,
        }


@dataclass
class TrialRunner:
    """Starts trials: ``zengine [launcher args] script [args, config replaced]`` in a process group of its own."""

    launcher_args: Sequence[str]
    script: str
    user_args: Sequence[str]
    exps_dir: str
    timeout: float
    arg_mappings: Optional[dict] = None
    python: str = sys.executable

    def command(self, config_path: str, cfg: dict) -> list[str]:
        args = with_mapped_args(with_config(self.user_args, config_path), self.arg_mappings, cfg)
        launcher = _without_port(self.launcher_args)
        return [
            self.python,
            "-m",
            "zengine.launcher.runner",
            *launcher,
            "--master_port",
            str(free_port()),
            self.script,
            *args,
        ]

    def run(self, trial: Trial, cfg: dict, reuse: bool = False) -> Trial:
        """Run ``trial`` with config ``cfg`` (its autotuning section a trial's); fills in its outcome."""
        folder = os.path.join(self.exps_dir, trial.candidate.name)
        os.makedirs(folder, exist_ok=True)
        trial.folder, trial.config = folder, cfg
        config_path = os.path.join(folder, "ds_config.json")
        metrics_path = os.path.join(folder, "metrics.json")
        cfg["autotuning"] = {
            **cfg.get("autotuning", {}),
            "enabled": True,
            "metric_path": metrics_path,
        }
        if reuse and os.path.exists(metrics_path):
            return self._read(trial, metrics_path, 0, "")
        if os.path.exists(metrics_path):
            os.remove(metrics_path)
        with open(config_path, "w") as f:
            json.dump(cfg, f, indent=2)
        cmd = self.command(config_path, cfg)
        with open(os.path.join(folder, "cmd.txt"), "w") as f:
            f.write(" ".join(cmd) + "\n")
        log_path = os.path.join(folder, "stdout.log")
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout ends every rank
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            try:
                code = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                trial.wall_seconds = time.perf_counter() - start
                trial.status, trial.reason = "timeout", f"stopped after {self.timeout:g} s"
                return trial
        trial.wall_seconds = time.perf_counter() - start
        with open(log_path, errors="replace") as f:
            text = f.read()
        return self._read(trial, metrics_path, code, text)

    def _read(self, trial: Trial, metrics_path: str, code: int, log: str) -> Trial:
        if code == 0 and os.path.exists(metrics_path):
            with open(metrics_path) as f:
                trial.metrics = json.load(f)
            trial.status = "ok"
            return trial
        if code == 0:
            trial.status = "no metrics"
            trial.reason = "the script ended before end_profile_step (does it train that many optimizer steps?)"
        elif code in (137, -signal.SIGKILL) or any(mark in log for mark in OOM_MARKS):
            trial.status, trial.reason = "out of memory", _last_error(log) or f"exit {code}"
        else:
            trial.status, trial.reason = "crashed", f"exit {code}: {_last_error(log)}"
        return trial


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def _without_port(args: Sequence[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--master_port":
            skip = True
            continue
        if arg.startswith("--master_port="):
            continue
        out.append(arg)
    return out


def _last_error(log: str) -> str:
    """The last line that names an error, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Killed" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
