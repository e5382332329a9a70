"""Learning-rate schedules named by the config's ``scheduler`` section, with DeepSpeed's
parameter names, defaults and formulas.

Every schedule is a pure function of ``last_batch_iteration``: the index of the last optimizer
step taken, -1 before the first. The engine calls ``step()`` once after every optimizer step
(global step), so optimizer step ``n`` (counting from 1) runs with the learning rate for
iteration ``n - 2``; the rate set at construction, for iteration -1, drives the first step.
This is DeepSpeed's timing, first steps included.

A schedule only needs ``optimizer.param_groups`` (a list of dicts holding ``"lr"``), so it works
on a torch optimizer, the engine's wrapper around one, or any object with that attribute.

Every constructor parameter has one ``Rule`` in ``PARAM_RULES`` (``params.py``): the constructors
check their arguments with it, and ``scheduler_param_problems`` checks a config's params with it
(names and required keys taken from the constructor signatures) before anything is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import warnings
from typing import Any

import torch

from zengine.optim.params import CHOICE, FLAG, INTEGER, NUMBER, ParamProblem, Rule, param_problems

__all__ = [
    "LRSchedule",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "ScheduleParamError",
    "build_scheduler",
    "scheduler_param_problems",
    "PARAM_RULES",
    "SCHEDULER_NAMES",
]

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"

_LR = Rule(NUMBER, minimum=0, per_group=True)
_STEPS = Rule(INTEGER, minimum=0)
_STEP_SIZE = Rule(INTEGER, minimum=1)

PARAM_RULES: dict[str, Rule] = {
    "last_batch_iteration": Rule(INTEGER, minimum=-1),
    # WarmupLR, WarmupDecayLR, WarmupCosineLR
    "warmup_min_lr": _LR,
    "warmup_max_lr": _LR,
    "warmup_num_steps": _STEPS,
    "warmup_type": Rule(CHOICE, choices=(WARMUP_LOG, WARMUP_LINEAR)),
    "total_num_steps": _STEP_SIZE,
    "warmup_min_ratio": Rule(NUMBER, minimum=0),
    "cos_min_ratio": Rule(NUMBER, minimum=0),
    # OneCycle
    "cycle_min_lr": _LR,
    "cycle_max_lr": _LR,
    "decay_lr_rate": Rule(NUMBER),
    "cycle_first_step_size": _STEP_SIZE,
    "cycle_second_step_size": _STEP_SIZE,
    "cycle_first_stair_count": _STEPS,
    "cycle_second_stair_count": _STEPS,
    "decay_step_size": _STEPS,
    "cycle_momentum": Rule(FLAG),
    "cycle_min_mom": Rule(NUMBER, minimum=0, per_group=True),
    "cycle_max_mom": Rule(NUMBER, minimum=0, per_group=True),
    "decay_mom_rate": Rule(NUMBER),
    # LRRangeTest
    "lr_range_test_min_lr": _LR,
    "lr_range_test_step_size": _STEP_SIZE,
    "lr_range_test_step_rate": Rule(NUMBER),
    "lr_range_test_staircase": Rule(FLAG),
}
"""The values each schedule parameter takes, by name (a name means the same in every schedule)."""


class ScheduleParamError(ValueError):
    """A schedule parameter with a wrong type or value; ``key`` names the parameter."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key} {problem}")


class LRSchedule:
    """What every schedule shares: the iteration counter, applying rates to the param groups,
    and the state that a checkpoint keeps. Subclasses define ``get_lr()``."""

    def __init__(self, optimizer: Any, last_batch_iteration: int = -1):
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(f"{type(optimizer).__name__} has no param_groups list to schedule")
        self.optimizer = optimizer
        self.last_batch_iteration = _checked("last_batch_iteration", last_batch_iteration)
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        """The learning rate of each param group at ``last_batch_iteration``."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the param groups."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and apply its rates."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint keeps (DeepSpeed's layout: ``last_batch_iteration``)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``; the param groups get the rates of the restored iteration, so
        training continues as if it had not stopped even when optimizer state is not reloaded."""
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            _set_lr(group, lr)
        self._last_lr = list(lrs)

    def _per_group(self, key: str, value: Any) -> list[float]:
        """One number for every group, from a number or a list with one entry per group."""
        count = len(self.optimizer.param_groups)
        checked = _checked(key, value)
        values = checked if isinstance(checked, list) else [checked] * count
        if len(values) != count:
            raise ScheduleParamError(
                key, f"has {len(values)} entries but the optimizer has {count} param groups"
            )
        return [float(entry) for entry in values]


class WarmupLR(LRSchedule):
    """Raise each group's lr from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` steps, then hold it at ``warmup_max_lr``.

    With ``w = max(2, warmup_num_steps)`` and ``i = last_batch_iteration``, the warmup fraction
    is ``log(i + 1) / log(w)`` for ``warmup_type="log"`` and ``i / w`` for ``"linear"``, and
    ``lr = min + (max - min) * fraction`` while ``i < w``. Before the first step (``i = -1``)
    lr is ``warmup_min_lr``.

    Args:
        warmup_min_lr: start lr (number, or one per group). Default 0.
        warmup_max_lr: peak lr (number, or one per group). Default: each group's lr at
            construction (DeepSpeed takes the first group's lr for all groups; with one lr
            everywhere the two agree).
        warmup_num_steps: steps of warmup. Default 1000.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: iteration to resume from; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [_as_float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = self._per_group("warmup_min_lr", warmup_min_lr)
        self.max_lrs = self._per_group("warmup_max_lr", warmup_max_lr)
        # log(w) divides, so DeepSpeed warms up over at least 2 steps.
        self.warmup_num_steps = max(2, _checked("warmup_num_steps", warmup_num_steps))
        self.warmup_type = _checked("warmup_type", warmup_type)
        self._apply()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]

    def _gamma(self) -> float:
        """Position between min (0) and max (1) at ``last_batch_iteration``."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.warmup_type, self.last_batch_iteration, self.warmup_num_steps
            )
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps``.

    After warmup, ``lr = min + (max - min) * max(0, (T - i) / max(1, T - w))`` with
    ``T = total_num_steps``, ``w = max(2, warmup_num_steps)`` and ``i = last_batch_iteration``.

    Args:
        total_num_steps: the step at which lr reaches ``warmup_min_lr`` again (required).
        warmup_max_lr: peak lr. Default 0.001 (DeepSpeed's default for this schedule).
        Others as in WarmupLR.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = _checked("total_num_steps", total_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        _warn_if_warmup_exceeds_total(self.total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRSchedule):
    """Warm up from ``warmup_min_ratio`` to 1, then follow a half cosine down to
    ``cos_min_ratio``; each ratio multiplies the group's lr at construction (its base lr).

    With ``w = max(2, warmup_num_steps)``, ``T = total_num_steps`` and
    ``i = last_batch_iteration``: during warmup ``ratio = r0 + (1 - r0) * fraction`` (fraction
    as in WarmupLR); after it, with ``p = min(1, (i - w + 1) / max(1, T - w))``,
    ``ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2``. Before the first
    step the ratio is 0, as in DeepSpeed.

    Args:
        total_num_steps: steps until the cosine reaches its floor (required).
        warmup_min_ratio: start ratio. Default 0.
        warmup_num_steps: steps of warmup. Default 1000.
        cos_min_ratio: end ratio. Default 0.0001.
        warmup_type: ``"log"`` (default) or ``"linear"``.
        last_batch_iteration: iteration to resume from; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _checked("total_num_steps", total_num_steps)
        self.warmup_min_ratio = float(_checked("warmup_min_ratio", warmup_min_ratio))
        self.cos_min_ratio = float(_checked("cos_min_ratio", cos_min_ratio))
        self.warmup_num_steps = max(2, _checked("warmup_num_steps", warmup_num_steps))
        self.warmup_type = _checked("warmup_type", warmup_type)
        _warn_if_warmup_exceeds_total(self.total_num_steps, self.warmup_num_steps)
        self.base_lrs = [_as_float(group["lr"]) for group in self.optimizer.param_groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        """The factor applied to every base lr at ``last_batch_iteration``."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            fraction = _warmup_fraction(self.warmup_type, i, self.warmup_num_steps)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so the rate rests at the floor past total_num_steps instead of rising again.
        progress = min(1.0, (i - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        # The base lrs travel too: a schedule rebuilt over an optimizer whose lrs were already
        # scheduled would otherwise take a scheduled lr for its base.
        return {**super().state_dict(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "base_lrs" in state:
            self.base_lrs = list(state["base_lrs"])
        super().load_state_dict(state)


class OneCycle(LRSchedule):
    """DeepSpeed's 1Cycle policy: lr climbs from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps, falls back over ``cycle_second_step_size`` steps, then
    decays; momentum, when cycled, moves the opposite way between ``cycle_max_mom`` and
    ``cycle_min_mom``.

    With ``b = last_batch_iteration + 1``, ``S = first + second`` and ``x = b / S - floor(b / S)``,
    the scale is ``x / r`` while ``x <= r = first / S`` and ``(x - 1) / (r - 1)`` after;
    ``lr = min_lr + (max_lr - min_lr) * scale`` and ``mom = max_mom - (max_mom - min_mom) * scale``.
    A stair count ``k > 0`` for a half holds the scale on ``k`` flat stairs over that half.
    From ``last_batch_iteration >= S``, with ``d = last_batch_iteration - S + 1``:
    ``lr = min_lr / (1 + decay_lr_rate * d / decay_step_size)`` and
    ``mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)``; a zero
    ``decay_step_size`` or rate leaves lr at ``min_lr`` and momentum at ``max_mom``.

    Momentum is beta1, as in DeepSpeed: cycled only when the optimizer's defaults hold ``betas``
    (an SGD's ``momentum`` is not cycled: a warning says so), and every write sets the betas to
    ``(momentum, 0.99)``: beta2 becomes 0.99 whatever the optimizer was given. Started afresh
    (``last_batch_iteration`` -1) the betas are ``(cycle_min_mom, 0.99)`` until the first step,
    DeepSpeed's start (the formula would give ``cycle_max_mom`` there).
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group("cycle_min_lr", cycle_min_lr)
        self.max_lrs = self._per_group("cycle_max_lr", cycle_max_lr)
        self.decay_lr_rate = float(_checked("decay_lr_rate", decay_lr_rate))
        self.first_step_size = float(_checked("cycle_first_step_size", cycle_first_step_size))
        if cycle_second_step_size is None:
            self.second_step_size = self.first_step_size
        else:
            self.second_step_size = float(
                _checked("cycle_second_step_size", cycle_second_step_size)
            )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _checked("cycle_first_stair_count", cycle_first_stair_count)
        if cycle_second_stair_count is None:
            self.second_stair_count = self.first_stair_count
        else:
            self.second_stair_count = _checked("cycle_second_stair_count", cycle_second_stair_count)
        self.decay_step_size = _checked("decay_step_size", decay_step_size)
        self.min_moms = self._per_group("cycle_min_mom", cycle_min_mom)
        self.max_moms = self._per_group("cycle_max_mom", cycle_max_mom)
        self.decay_mom_rate = float(_checked("decay_mom_rate", decay_mom_rate))
        self.cycle_momentum = bool(_checked("cycle_momentum", cycle_momentum)) and self._has_betas()
        self._apply()
        if self.cycle_momentum and self.last_batch_iteration == -1:
            self._set_betas(self.min_moms)  # DeepSpeed's start, before the first step

    # DeepSpeed's OneCycle pairs every cycled beta1 with this beta2
    BETA2 = 0.99

    def _has_betas(self) -> bool:
        """Whether the optimizer's defaults hold ``betas`` (DeepSpeed's test); warns when not."""
        if "betas" in (getattr(self.optimizer, "defaults", None) or {}):
            return True
        warnings.warn(
            f"OneCycle: cycle_momentum is off because {type(self.optimizer).__name__}'s defaults "
            "have no 'betas' (as in DeepSpeed, only an Adam-style beta1 is cycled)"
        )
        return False

    def _set_betas(self, momentums: list[float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, momentums):
            group["betas"] = (momentum, self.BETA2)

    def _scale(self) -> float:
        """Position between min (0) and max (1) lr within the cycle."""
        b = self.last_batch_iteration + 1
        x = b / self.total_size - math.floor(b / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1.0) / (self.step_ratio - 1.0), self.second_stair_count
        if stairs > 0:
            # Counted from the integer offset in the cycle: the float scale can land a hair under
            # a stair edge, and flooring it would drop a whole stair.
            offset = b % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_intervals(self) -> float:
        """Decay intervals elapsed since the cycle ended (0 when decay is off)."""
        if self.decay_step_size == 0:
            return 0.0
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        factor = 1.0 + self.decay_lr_rate * self._decay_intervals()
        return [low / factor for low in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """Each group's momentum (beta1) at ``last_batch_iteration``; None when not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        factor = 1.0 + self.decay_mom_rate * self._decay_intervals()
        return [high * factor for high in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        momentums = self.get_mom()
        if momentums is not None:
            self._set_betas(momentums)


class LRRangeTest(LRSchedule):
    """Grow lr from ``lr_range_test_min_lr`` to find the largest rate that still trains.

    ``lr = min_lr * (1 + lr_range_test_step_rate * (last_batch_iteration + 1) / lr_range_test_step_size)``,
    with the quotient floored when ``lr_range_test_staircase``.

    Args:
        lr_range_test_min_lr: start lr (number, or one per group). Default 0.001.
        lr_range_test_step_size: steps per unit of increase. Default 2000.
        lr_range_test_step_rate: increase per unit. Default 1.0.
        lr_range_test_staircase: grow in stairs instead of continuously. Default False.
        last_batch_iteration: iteration to resume from; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group("lr_range_test_min_lr", lr_range_test_min_lr)
        self.step_size = _checked("lr_range_test_step_size", lr_range_test_step_size)
        self.step_rate = float(_checked("lr_range_test_step_rate", lr_range_test_step_rate))
        self.staircase = _checked("lr_range_test_staircase", lr_range_test_staircase)
        self._apply()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1.0 + self.step_rate * interval) for low in self.min_lrs]


_SCHEDULES: dict[str, type[LRSchedule]] = {
    cls.__name__.lower(): cls
    for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}

SCHEDULER_NAMES: tuple[str, ...] = tuple(cls.__name__ for cls in _SCHEDULES.values())
"""The ``scheduler.type`` values build_scheduler accepts (matched case-insensitively)."""


def _declared_params(cls: type[LRSchedule]) -> dict[str, Rule]:
    """The config params ``cls`` takes: its constructor's parameters, each with its rule from
    PARAM_RULES, required when it has no default and nullable when its default is None."""
    rules = {}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "optimizer"):
            continue
        rule = PARAM_RULES[name]  # a KeyError here at import: a new parameter needs its rule
        if parameter.default is inspect.Parameter.empty:
            rule = dataclasses.replace(rule, required=True)
        elif parameter.default is None:
            rule = dataclasses.replace(rule, nullable=True)
        rules[name] = rule
    return rules


_PARAMS: dict[str, dict[str, Rule]] = {
    name: _declared_params(cls) for name, cls in _SCHEDULES.items()
}


def build_scheduler(type_name: str, params: dict | None, optimizer: Any) -> LRSchedule:
    """Build the schedule the config's ``scheduler`` section names, over ``optimizer``.

    Raises:
        ValueError: an unknown type, or parameters that are unknown, missing, mistyped or out
            of range (all of them, one per line); the message names ``scheduler.type`` or
            ``scheduler.params.<key>``.
    """
    params = dict(params or {})
    problems = scheduler_param_problems(type_name, params)
    cls = _SCHEDULES[type_name.lower()]
    if problems:
        raise ValueError(
            "\n".join(f"scheduler.params.{key} {text} ({cls.__name__})" for key, text in problems)
        )
    try:
        return cls(optimizer, **params)
    except ScheduleParamError as err:
        raise ValueError(f"scheduler.params.{err.key} {err.problem} ({cls.__name__})") from None


def scheduler_param_problems(type_name: str, params: dict) -> list[tuple[str, str]]:
    """Every problem build_scheduler would find in ``params`` for the schedule ``type_name``
    without an optimizer, as ``(key, text)`` pairs (see ``params.py``). Only the length of a
    per-group list is left to the build, which knows the param groups.

    Raises:
        ValueError: ``type_name`` is not a schedule build_scheduler knows.
    """
    if not isinstance(type_name, str) or type_name.lower() not in _SCHEDULES:
        raise ValueError(_unknown_type_message(type_name))
    return param_problems(
        params, _PARAMS[type_name.lower()], _SCHEDULES[type_name.lower()].__name__
    )


def _unknown_type_message(type_name: Any) -> str:
    message = f"scheduler.type {type_name!r} is not a known schedule"
    if isinstance(type_name, str):
        close = difflib.get_close_matches(type_name.lower(), list(_SCHEDULES), n=1)
        if close:
            message += f"; did you mean {_SCHEDULES[close[0]].__name__!r}?"
    return message + f" (supported: {', '.join(SCHEDULER_NAMES)})"


def _warmup_fraction(warmup_type: str, iteration: int, warmup_num_steps: int) -> float:
    """How far warmup has come after ``iteration`` (0 at iteration 0, toward 1 at the end)."""
    if warmup_type == WARMUP_LOG:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


def _warn_if_warmup_exceeds_total(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        warnings.warn(
            f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}"
        )


def _set_lr(group: dict, lr: float) -> None:
    # A tensor lr (capturable or fused optimizers) is updated in place so captured graphs see it.
    if isinstance(group.get("lr"), torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def _as_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _checked(key: str, value: Any) -> Any:
    """``value`` of the constructor parameter ``key`` as its rule in PARAM_RULES parses it."""
    try:
        return PARAM_RULES[key].parse(value)
    except ParamProblem as problem:
        raise ScheduleParamError(key, str(problem)) from None
