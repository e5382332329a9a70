"""What each ``params`` entry of the config's ``optimizer`` and ``scheduler`` sections accepts.

One ``Rule`` per parameter says which values it takes. ``build_optimizer`` and
``build_scheduler`` apply the rules when they build, and ``load_config`` applies the very same
rules (through ``optimizer_param_problems`` and ``scheduler_param_problems``) before any process
group exists, so a config is refused at load for exactly what the build would refuse.

A problem is a pair ``(key, text)`` whose text reads on from the key path:
``("lr", "must be a number, got 'auto'")``. The builders raise
``optimizer.params.lr must be a number, got 'auto'``; the config loader lists
``optimizer.params.lr: must be a number, got 'auto'`` among the config's other problems.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "NUMBER",
    "INTEGER",
    "FLAG",
    "CHOICE",
    "NUMBERS",
    "ANY",
    "ParamProblem",
    "Rule",
    "param_problems",
]

NUMBER = "number"
"""An int or float (never a boolean or a string), finite."""
INTEGER = "integer"
"""A whole number; an integral float such as 100.0 (a step count computed in Python) is taken as an int."""
FLAG = "flag"
"""true or false."""
CHOICE = "choice"
"""One of ``Rule.choices``."""
NUMBERS = "numbers"
"""A list of ``Rule.length`` numbers, e.g. Adam's betas."""
ANY = "any"
"""Passed through unchecked (an argument zengine has no rule for, e.g. of a rarely used torch optimizer)."""


class ParamProblem(ValueError):
    """A value a ``Rule`` refuses; the message reads on from the key (``must be >= 0, got -1``)."""


@dataclass(frozen=True)
class Rule:
    """The values one optimizer or schedule parameter accepts.

    ``minimum`` is an inclusive lower bound, or exclusive with ``above_minimum``; ``below`` an
    exclusive upper bound. For ``NUMBERS`` the bounds hold for every entry, and an entry whose
    index is in ``null_entries`` may be null. ``per_group`` also accepts a list with one value per
    param group (its length is checked against the optimizer when the schedule is built).
    ``nullable`` accepts null; ``required`` marks a parameter without a default.
    """

    kind: str
    minimum: Optional[float] = None
    above_minimum: bool = False
    below: Optional[float] = None
    choices: tuple = ()
    length: int = 0
    null_entries: tuple = ()
    per_group: bool = False
    nullable: bool = False
    required: bool = False

    def parse(self, value: Any) -> Any:
        """``value`` as the builder passes it on (an integral float step count becomes an int, a
        list of numbers a tuple); raises ``ParamProblem`` when the rule refuses it."""
        if value is None and self.nullable:
            return None
        if self.per_group and isinstance(value, (list, tuple)):
            if not value:
                raise ParamProblem(
                    f"must be a number or a list with one number per param group, got {value!r}"
                )
            return [self._one(entry) for entry in value]
        return self._one(value)

    def problem(self, value: Any) -> Optional[str]:
        """Why the rule refuses ``value``, or None when it accepts it."""
        try:
            self.parse(value)
        except ParamProblem as problem:
            return str(problem)
        return None

    def _one(self, value: Any) -> Any:
        if self.kind == ANY:
            return value
        if self.kind == FLAG:
            if not isinstance(value, bool):
                raise ParamProblem(f"must be true or false, got {value!r}")
            return value
        if self.kind == CHOICE:
            if value not in self.choices:
                raise ParamProblem(
                    f"must be {' or '.join(repr(choice) for choice in self.choices)}, got {value!r}"
                )
            return value
        if self.kind == NUMBERS:
            return self._numbers(value)
        if self.kind == INTEGER:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ParamProblem(f"must be an integer, got {value!r}")
        elif not _is_number(value):
            raise ParamProblem(f"must be a number, got {value!r}")
        elif not math.isfinite(value):
            raise ParamProblem(f"must be a finite number, got {value!r}")
        if not self._in_range(value):
            raise ParamProblem(f"must be {self._range_text()}, got {value!r}")
        return value

    def _numbers(self, value: Any) -> tuple:
        entries_ok = (
            isinstance(value, (list, tuple))
            and len(value) == self.length
            and all(
                (entry is None and index in self.null_entries)
                or (_is_number(entry) and math.isfinite(entry))
                for index, entry in enumerate(value)
            )
        )
        if not entries_ok:
            raise ParamProblem(f"must be a list of {self.length} numbers, got {value!r}")
        if not all(entry is None or self._in_range(entry) for entry in value):
            raise ParamProblem(f"must lie in {self._range_text()}, got {list(value)!r}")
        return tuple(None if entry is None else float(entry) for entry in value)

    def _in_range(self, value: float) -> bool:
        if self.minimum is not None and (
            value <= self.minimum if self.above_minimum else value < self.minimum
        ):
            return False
        return self.below is None or value < self.below

    def _range_text(self) -> str:
        """``>= 0``, ``> 0`` or, with an upper bound, an interval such as ``[0, 1)``."""
        low = _plain_number(self.minimum)
        if self.below is not None:
            return f"{'(' if self.above_minimum else '['}{low}, {_plain_number(self.below)})"
        return f"{'>' if self.above_minimum else '>='} {low}"


def param_problems(
    params: Mapping[str, Any], rules: Mapping[str, Rule], owner: str
) -> list[tuple[str, str]]:
    """Every problem of ``params`` against ``rules``: unknown keys (with the near miss and the
    accepted keys), refused values and missing required keys. ``owner`` names what takes the
    parameters in messages, e.g. ``"the Adam optimizer"`` or ``"WarmupLR"``."""
    problems = []
    for key, value in params.items():
        rule = rules.get(key)
        if rule is None:
            problems.append((key, _unknown_key_text(key, rules, owner)))
            continue
        text = rule.problem(value)
        if text:
            problems.append((key, text))
    for key, rule in rules.items():
        if rule.required and key not in params:
            problems.append((key, f"is required by {owner}"))
    return problems


def _unknown_key_text(key: Any, rules: Mapping[str, Rule], owner: str) -> str:
    text = f"is not a parameter of {owner}"
    close = difflib.get_close_matches(key, list(rules), n=1) if isinstance(key, str) else []
    if close:
        text += f"; did you mean {close[0]!r}?"
    return text + f" (accepted: {', '.join(sorted(rules))})"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain_number(value: Optional[float]) -> str:
    """0.0 -> "0", 0.5 -> "0.5": bounds read as a person writes them."""
    return "" if value is None else f"{value:g}"
