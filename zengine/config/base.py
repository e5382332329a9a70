"""The value types and the base model that every config section is built from.

Every model forbids unknown keys and re-validates on assignment. Key names,
meanings and defaults follow DeepSpeed's config. Cross-field checks raise one
``ValueError`` whose lines each start with the key path, relative to the
model, followed by ``": "``; ``load.py`` prefixes the model's own path.

Types are strict where JSON's are easy to confuse: a flag takes only true or
false (not 1, not "yes"), and an integer key refuses a boolean and a float
(``"stage": true`` and ``"train_batch_size": 2.0`` are errors), while a
decimal key takes any number but a boolean (``"gradient_clipping": 1`` is
fine). Sizes keep DeepSpeed's spellings (5e8, "5e8"); an integer or decimal
written as a string ("8", "1.0") is read as before.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Tuple, Union, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    ValidationError,
    model_validator,
)


def _whole_number(value: Any) -> Any:
    """Accept 500000000, 5e8, "5e8" or "500_000_000" as the int 500000000."""
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, not a boolean ({value!r})")
    if isinstance(value, int):
        return value
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text.replace("_", ""))
        except ValueError:
            raise ValueError(
                f'expected a whole number such as 500000000, 5e8 or "5e8"; got {value!r}'
            ) from None
    if isinstance(number, float) and math.isfinite(number) and number.is_integer():
        return int(number)
    raise ValueError(f'expected a whole number such as 500000000, 5e8 or "5e8"; got {value!r}')


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, not a boolean ({value!r})")
    return value


def _integer(value: Any) -> Any:
    """Refuse a boolean or a float where an int is expected (pydantic would take true as 1 and
    2.0 as 2); a string must spell an int ("8")."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, not a boolean ({value!r})")
    if isinstance(value, float):
        raise ValueError(f"expected an integer, not a decimal number ({value!r})")
    if isinstance(value, str) and not value.strip().lstrip("+-").isdigit():
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _auto_is_unset(value: Any) -> Any:
    """Hugging Face configs write "auto" for a batch key the Trainer fills in."""
    return None if value == "auto" else _integer(value)


Integer = Annotated[int, BeforeValidator(_integer)]
"""An int: not a boolean, not a float (even 2.0)."""
Number = Annotated[float, BeforeValidator(_not_bool)]
"""A decimal number; an int is welcome, a boolean is not."""
Flag = StrictBool
"""true or false, nothing else (not 1, not "yes")."""


def _flag_or_auto(value: Any) -> Any:
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f'expected true, false or "auto" ({value!r})')


FlagOrAuto = Annotated[Union[bool, Literal["auto"]], PlainValidator(_flag_or_auto)]
"""true, false or "auto" (zengine decides), nothing else."""
Size = Annotated[int, BeforeValidator(_whole_number), Field(ge=0)]
"""A count of elements or bytes; 0 is meaningful (e.g. no persistence)."""
PositiveSize = Annotated[int, BeforeValidator(_whole_number), Field(ge=1)]
"""A buffer or bucket size, which must hold at least one element."""
Count = Annotated[int, BeforeValidator(_integer), Field(ge=1)]
"""A small positive count (buffers, threads, steps)."""
NEVER = 2**63 - 1
"""An interval of steps that never comes round: what ``float("inf")`` becomes (accelerate's ``steps_per_print``)."""


def _interval(value: Any) -> Any:
    if isinstance(value, float) and value == math.inf:
        return NEVER
    return _integer(value)


Interval = Annotated[int, BeforeValidator(_interval), Field(ge=1)]
"""A positive count of steps between events; ``float("inf")``: never."""
BatchSize = Annotated[Optional[Annotated[int, Field(ge=1)]], BeforeValidator(_auto_is_unset)]
"""A batch key; None (or "auto") until ``load_config`` resolves it."""


class _Section(BaseModel):
    """Base of every config model: strict keys, checked assignment, finite floats."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # DeepSpeed's config models drop a key whose value is "auto" and use their default for it:
    # Hugging Face's documented ZeRO configs reach zero.Init with "auto" still in the ZeRO section
    # (the Trainer fills it only after the model is built). Sections with DeepSpeed's behaviour
    # set this; elsewhere "auto" is refused with a hint (it may change numbers: fp16.enabled).
    AUTO_MEANS_DEFAULT: ClassVar[bool] = False
    # ... but for keys that decide what is done, not how fast ("stage": "auto" asks for a tuner)
    AUTO_REFUSED: ClassVar[Tuple[str, ...]] = ()

    @classmethod
    def _without_auto(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        """``data`` without the keys set to "auto", but for fields that take "auto" as a value."""

        def takes_auto(key: str) -> bool:
            field = cls.model_fields.get(key)
            return field is not None and "auto" in get_args(field.annotation) + tuple(
                a for arg in get_args(field.annotation) for a in get_args(arg)
            )

        return {
            k: v
            for k, v in data.items()
            if not (v == "auto" and not takes_auto(k) and k not in cls.AUTO_REFUSED)
        }

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
        """Rewrite older DeepSpeed spellings in ``data`` (a private copy of the raw section).
        Returns the data to validate and the problems met on the way, ``"key: text"`` lines
        that are reported together with the section's other problems."""
        return data, []

    @model_validator(mode="wrap")
    @classmethod
    def _prepare_then_validate(cls, data: Any, handler: Any) -> Any:
        """``_prepare``, then the fields; a wrap validator rather than a "before" one so that a
        problem met while rewriting (two spellings of one key) does not hide the field problems."""
        problems: List[str] = []
        if isinstance(data, dict):
            if cls.AUTO_MEANS_DEFAULT:
                data = cls._without_auto(data)
            data, problems = cls._prepare(dict(data))
        try:
            section = handler(data)
        except ValidationError as error:
            if not problems:
                raise
            raise _with_problems(error, data, problems) from None
        if problems:
            raise ValueError("\n".join(problems))
        return section


def _with_problems(error: ValidationError, data: Any, problems: List[str]) -> ValidationError:
    """``error`` with ``problems`` added as one more error of the section itself."""
    details = [
        {
            "type": item["type"],
            "loc": item["loc"],
            "input": item["input"],
            **({"ctx": item["ctx"]} if "ctx" in item else {}),
        }
        for item in error.errors()
    ]
    details.append(
        {
            "type": "value_error",
            "loc": (),
            "input": data,
            "ctx": {"error": ValueError("\n".join(problems))},
        }
    )
    return ValidationError.from_exception_data(error.title, details)
