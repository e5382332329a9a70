"""What the tuner may choose: the candidates, built from what the user's config leaves open.

A key the user's config sets to a value is kept; a key that is absent or ``"auto"`` (``"all"`` for the
stage) is the tuner's to choose, as DeepSpeed's autotuner treats them:

- ``zero_optimization.stage``: 0-3;
- ``offload_optimizer`` / ``offload_param`` (stage 3): none or CPU, and NVMe where the section names an
  ``nvme_path``; on a CPU-only machine CPU offload moves nothing (the host is the device), so only NVMe;
- ``train_micro_batch_size_per_gpu``: powers of two within the ``autotuning`` section's bounds; with
  ``train_batch_size`` set, only those that divide it, the accumulation steps making up the rest;
- with ``fast: false``, around the best of those: the bucket sizes, the stage-3 gather units and
  ``sub_group_size`` (:func:`knob_choices`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..config.autotuning import AutotuningConfig

OPEN = (None, "auto", "all")  # a value the tuner fills in


@dataclass(frozen=True)
class Candidate:
    """One configuration to try: the family (stage, offload), the batch split and any knobs."""

    stage: int
    offload_optimizer: str  # "none", "cpu" or "nvme"
    offload_param: str
    micro_batch: int
    accumulation: int
    knobs: tuple[tuple[str, Any], ...] = field(default=())  # (dotted config key, value), sorted

    @property
    def family(self) -> tuple[int, str, str]:
        return (self.stage, self.offload_optimizer, self.offload_param)

    @property
    def name(self) -> str:
        parts = [f"z{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt-{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param-{self.offload_param}")
        parts += [f"mb{self.micro_batch}", f"gas{self.accumulation}"]
        parts += [f"{key.rsplit('.', 1)[-1]}-{_short(value)}" for key, value in self.knobs]
        return "_".join(parts)

    def with_knob(self, key: str, value: Any) -> "Candidate":
        knobs = dict(self.knobs)
        knobs[key] = value
        return Candidate(
            self.stage,
            self.offload_optimizer,
            self.offload_param,
            self.micro_batch,
            self.accumulation,
            tuple(sorted(knobs.items())),
        )

    def delta(self, world_size: int) -> dict[str, Any]:
        """The config keys this candidate sets, dotted (for the report)."""
        out = {
            "zero_optimization.stage": self.stage,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "train_batch_size": self.micro_batch * self.accumulation * world_size,
        }
        if self.offload_optimizer != "none":
            out["zero_optimization.offload_optimizer.device"] = self.offload_optimizer
        if self.offload_param != "none":
            out["zero_optimization.offload_param.device"] = self.offload_param
        out.update(self.knobs)
        return out

    def config(self, base: dict, world_size: int) -> dict:
        """The user's config with this candidate's choices written in (``base`` is left as it is)."""
        cfg = copy.deepcopy(base)
        zero = cfg.setdefault("zero_optimization", {})
        zero["stage"] = self.stage
        for section, device in (
            ("offload_optimizer", self.offload_optimizer),
            ("offload_param", self.offload_param),
        ):
            if device == "none":
                zero.pop(section, None)
            else:
                zero[section] = {**zero.get(section, {}), "device": device}
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.accumulation
        cfg["train_batch_size"] = self.micro_batch * self.accumulation * world_size
        for key, value in self.knobs:
            set_dotted(cfg, key, value)
        return cfg


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float)) and value >= 1000:
        exponent = int(math.floor(math.log10(value)))
        return f"{value / 10**exponent:g}e{exponent}"
    return str(value)


def get_dotted(cfg: dict, key: str) -> Any:
    """``cfg["a"]["b"]`` for ``"a.b"``; None where a part is missing."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_dotted(cfg: dict, key: str, value: Any) -> None:
    node = cfg
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


@dataclass(frozen=True)
class Space:
    """The choices the user's config leaves open, and the batch rules every candidate keeps."""

    stages: tuple[int, ...]
    optimizer_offloads: tuple[str, ...]
    param_offloads: tuple[str, ...]
    micro_batches: Optional[tuple[int, ...]]  # None: tuned within the section's bounds
    global_batch: Optional[int]  # fixed train_batch_size, or None
    accumulation: Optional[int]  # fixed gradient_accumulation_steps, or None
    settings: AutotuningConfig

    @classmethod
    def from_config(cls, user: dict, settings: AutotuningConfig, cpu_training: bool) -> "Space":
        zero = user.get("zero_optimization") or {}
        stage = zero.get("stage")
        stages = (0, 1, 2, 3) if stage in OPEN else (int(stage),)
        opt = _offload_choices(zero.get("offload_optimizer"), cpu_training)
        par = _offload_choices(zero.get("offload_param"), cpu_training)
        mb = user.get("train_micro_batch_size_per_gpu")
        gb, gas = user.get("train_batch_size"), user.get("gradient_accumulation_steps")
        return cls(
            stages,
            opt,
            par,
            None if mb in OPEN else (int(mb),),
            None if gb in OPEN else int(gb),
            None if gas in OPEN else int(gas),
            settings,
        )

    def families(self) -> list[tuple[int, str, str]]:
        """(stage, optimizer offload, parameter offload) triples that exist: offload needs stage 1+
        (DeepSpeed's rule), parameter offload stage 3 and an offloaded optimizer."""
        out = []
        for stage in self.stages:
            for opt in self.optimizer_offloads:
                for par in self.param_offloads:
                    if stage == 0 and opt != "none":
                        continue
                    if par != "none" and (stage != 3 or opt == "none"):
                        continue
                    out.append((stage, opt, par))
        if not out:
            raise ValueError(
                "autotuning: the config's fixed choices leave nothing to try (parameter offload needs stage 3 "
                "and an offloaded optimizer; offload needs stage 1 or more)"
            )
        return out

    def batch_splits(self, world_size: int) -> list[tuple[int, int]]:
        """(micro batch, accumulation steps) pairs the config and the section's bounds allow."""
        s = self.settings
        if self.micro_batches is not None:
            mbs: Iterable[int] = self.micro_batches
        else:
            mbs = _powers_of_two(
                s.min_train_micro_batch_size_per_gpu, s.max_train_micro_batch_size_per_gpu
            )
        out = []
        for mb in mbs:
            if self.global_batch is not None:
                gas, rest = divmod(self.global_batch, mb * world_size)
                if rest or gas < 1:
                    continue
            else:
                gas = self.accumulation or 1
            total = mb * gas * world_size
            if total < s.min_train_batch_size or (
                s.max_train_batch_size is not None and total > s.max_train_batch_size
            ):
                continue
            out.append((mb, gas))
        if not out:
            raise ValueError(
                f"autotuning: no micro-batch size fits the batch rules (train_batch_size {self.global_batch}, "
                f"micro batch {s.min_train_micro_batch_size_per_gpu}..{s.max_train_micro_batch_size_per_gpu}, "
                f"global batch {s.min_train_batch_size}..{s.max_train_batch_size}, {world_size} ranks)"
            )
        return out

    def candidates(self, world_size: int) -> list[Candidate]:
        """Every family at every batch split (the memory model then rules out what cannot fit)."""
        return [
            Candidate(stage, opt, par, mb, gas)
            for stage, opt, par in self.families()
            for mb, gas in self.batch_splits(world_size)
        ]


def _offload_choices(section: Optional[dict], cpu_training: bool) -> tuple[str, ...]:
    device = (section or {}).get("device")
    if device not in OPEN:
        return (str(device),)
    choices = ["none"] if cpu_training else ["none", "cpu"]
    if (section or {}).get("nvme_path"):
        choices.append("nvme")
    return tuple(choices)


def _powers_of_two(low: int, high: int) -> list[int]:
    out, value = [], 1
    while value <= high:
        if value >= low:
            out.append(value)
        value *= 2
    if low not in out and low <= high:
        out.insert(0, low)
    return out


def knob_choices(candidate: Candidate, user: dict, num_params: int) -> list[tuple[str, list]]:
    """The settings ``fast: false`` tries around ``candidate``, one key at a time, each a few values
    spread around the model's size; keys the user's config sets are left alone."""
    zero = user.get("zero_optimization") or {}

    def open_(key: str) -> bool:
        return zero.get(key) in OPEN

    spread = sorted({max(1 << 16, int(num_params * f)) for f in (1 / 16, 1 / 4, 1.0)})
    out: list[tuple[str, list]] = []
    if open_("reduce_bucket_size"):
        out.append(("zero_optimization.reduce_bucket_size", spread))
    if open_("overlap_comm") and candidate.stage >= 1:
        out.append(("zero_optimization.overlap_comm", [True, False]))
    if candidate.stage in (1, 2) and open_("allgather_bucket_size"):
        out.append(("zero_optimization.allgather_bucket_size", spread))
    if candidate.stage == 3:
        if open_("stage3_prefetch_bucket_size"):
            out.append(("zero_optimization.stage3_prefetch_bucket_size", spread))
        if open_("stage3_gather_units"):
            out.append(("zero_optimization.stage3_gather_units", ["auto", "module"]))
    if candidate.offload_optimizer != "none" and open_("sub_group_size"):
        out.append(
            ("zero_optimization.sub_group_size", sorted({max(1 << 16, num_params // 4), 10**9}))
        )
    return out
