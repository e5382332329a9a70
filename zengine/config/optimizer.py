"""The optimizer step's sections: the ``optimizer`` and ``scheduler`` zengine builds, and
``nonfinite_gradients``, what a step does when the gradient norm is NaN or Inf.

The ``optimizer`` and ``scheduler`` params are checked against the rules the
builders in ``zengine.optim`` apply, so they fail here, before any process
group starts.
"""

from __future__ import annotations

import difflib
from typing import Any, Dict, List, Tuple

from pydantic import Field, field_validator, model_validator

from zengine.optim import SCHEDULER_NAMES, optimizer_param_problems, scheduler_param_problems

from .base import Count, Flag, Integer, _Section

SUPPORTED_OPTIMIZERS: Tuple[str, ...] = (
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "RMSprop",
    "CPUAdam",
    "DeepSpeedCPUAdam",
)
"""``optimizer.type`` values zengine can build (matched case-insensitively)."""

SUPPORTED_SCHEDULERS: Tuple[str, ...] = SCHEDULER_NAMES
"""``scheduler.type`` values zengine can build (matched case-insensitively)."""

# DeepSpeed optimizers zengine does not build, named so the error says so.
_DEEPSPEED_ONLY_OPTIMIZERS = (
    "Lamb",
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    "Lion",
    "MuAdam",
    "MuAdamW",
    "MuSGD",
    "Muon",
)


def _canonical_type(
    value: Any, supported: Tuple[str, ...], kind: str, elsewhere: Tuple[str, ...] = ()
) -> str:
    """Return the canonical spelling of ``value`` among ``supported``."""
    if not isinstance(value, str):
        raise ValueError(
            f"the {kind} type must be a string such as {supported[0]!r}; got {value!r}"
        )
    by_lower = {name.lower(): name for name in supported}
    if value.lower() in by_lower:
        return by_lower[value.lower()]
    known = ", ".join(supported)
    article = "an" if kind[0] in "aeiou" else "a"
    if value.lower() in {name.lower() for name in elsewhere}:
        raise ValueError(
            f"{value!r} is a DeepSpeed {kind} that zengine does not implement; use one of {known}"
        )
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
    raise ValueError(f"{value!r} is not {article} {kind} zengine can build (one of {known}){hint}")


class _NamedSection(_Section):
    """A ``{"type": name, "params": {...}}`` section: the name and the params are both checked
    here, the params with the rules of the builder that will use them."""

    type: str = Field(
        description="Name, matched case-insensitively and stored in its canonical spelling."
    )
    params: Dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the named type, checked against the "
        "parameters it takes and their types and ranges.",
    )

    @field_validator("params", mode="before")
    @classmethod
    def _null_params(cls, value: Any) -> Any:
        return {} if value is None else value


def _raise_param_problems(problems: List[Tuple[str, str]]) -> None:
    """Raise the ``(key, text)`` problems of a section's params, one ``params.<key>: text`` line each."""
    if problems:
        raise ValueError("\n".join(f"params.{key}: {text}" for key, text in problems))


class OptimizerConfig(_NamedSection):
    """The optimizer zengine builds when ``initialize`` is given none (type: one of SUPPORTED_OPTIMIZERS;
    params: lr, betas, eps, weight_decay...)."""

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> str:
        return _canonical_type(value, SUPPORTED_OPTIMIZERS, "optimizer", _DEEPSPEED_ONLY_OPTIMIZERS)

    @model_validator(mode="after")
    def _valid_params(self) -> "OptimizerConfig":
        _raise_param_problems(optimizer_param_problems(self.type, self.params))
        return self


class SchedulerConfig(_NamedSection):
    """The learning-rate scheduler zengine builds when ``initialize`` is given none (type: one of
    SUPPORTED_SCHEDULERS; params: warmup_num_steps...)."""

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> str:
        return _canonical_type(value, SUPPORTED_SCHEDULERS, "scheduler")

    @model_validator(mode="after")
    def _valid_params(self) -> "SchedulerConfig":
        _raise_param_problems(scheduler_param_problems(self.type, self.params))
        return self


class NonFiniteGradientsConfig(_Section):
    """What a boundary step does when the global gradient norm is NaN or Inf (zengine's own key)."""

    skip: Flag = Field(
        True,
        description="Skip the step on every rank (counted, logged); false applies it "
        "anyway in fp32/bf16 (fp16 with dynamic scaling always skips).",
    )
    max_consecutive_skips: Integer = Field(
        50,
        ge=0,
        description="Raise, naming the first parameter whose "
        "gradient is non-finite, after this many skipped steps in a row; "
        "0 never raises.",
    )
    warn_every: Count = Field(100, description="Log the first skip, then every this many skips.")
