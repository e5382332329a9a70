"""``load_config``: read a JSON file or dict, validate it, resolve the batch sizes.

Files are read with hjson, as DeepSpeed reads them, so ``//``, ``#`` and ``/* */``
comments and trailing commas are accepted; plain JSON reads exactly as with
``json``. Every problem found in a config is collected and raised as one
``ConfigError`` with one line per problem, each starting with the key path, so
a user fixes the whole file in one pass, before any process group or model work
starts.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type, Union

import hjson
from pydantic import BaseModel, ValidationError

from .batch import GAS, MICRO, TBS, BatchSizes, resolve_batch_sizes, resolve_elastic_batch_sizes
from .elastic import ElasticityConfig
from .models import ZengineConfig
from .precision import BF16Config, FP16Config, precision_problem
from .unsupported import screen, unsupported_keys_under

ConfigSource = Union[str, "os.PathLike[str]", Mapping]

_AUTO_HINT = (
    '; "auto" values are filled in by the Hugging Face Trainer integration or by the autotuner '
    "(`zengine --autotuning tune|run`), not by zengine.initialize (nor by DeepSpeed's), so write the "
    "value here or tune the config first"
)
_UNQUOTED_HINT = (
    "; a value written without quotes runs to the end of its line in a config file (hjson), "
    "comma included: check the quotes"
)
# A model validator's message line: "relative.key.path: text".
_KEYED_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): (.*)$")


class ConfigError(ValueError):
    """A config that zengine cannot train with; the message lists every problem."""


class ConfigWarning(UserWarning):
    """A config key was accepted but zengine does not act on it."""


def load_config(config: ConfigSource, world_size: int) -> ZengineConfig:
    """Read, validate and resolve a DeepSpeed-style config.

    ``config`` is a path to a JSON file (comments and trailing commas allowed, as DeepSpeed
    allows them) or a dict (not modified).
    ``world_size`` is the data-parallel world size that the batch rule uses.
    Raises ``ConfigError`` listing every problem. Keys that zengine accepts
    without acting on them are named in one ``ConfigWarning``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"load_config: world_size must be a positive int, got {world_size!r}")
    source, raw = _read(config)
    problems, ignored = screen(raw)
    cfg: Optional[ZengineConfig] = None
    with warnings.catch_warnings(record=True) as deprecations:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            cfg = ZengineConfig.model_validate(raw)
        except ValidationError as error:
            problems.extend(_describe(error))
            problems.extend(_precision_problem(raw, problems))
    batch = _batch_keys(cfg, raw)
    elastic = _elastic_section(cfg, raw)
    given = [key for key in (TBS, MICRO, GAS) if raw.get(key) not in (None, "auto")]
    resolved: Optional[BatchSizes] = None
    elastic_world_sizes: Tuple[int, ...] = ()
    try:
        if isinstance(elastic, ElasticityConfig):
            resolved, elastic_world_sizes = resolve_elastic_batch_sizes(elastic, world_size, given)
        elif elastic is None and batch is not None:
            resolved = resolve_batch_sizes(*batch, world_size)
    except ValueError as error:
        problems.extend(str(error).splitlines())
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ConfigError(
            f"invalid zengine config {source} ({count}):\n" + "\n".join(f"  {p}" for p in problems)
        )
    assert cfg is not None and resolved is not None
    cfg.train_batch_size = resolved.train_batch_size
    cfg.train_micro_batch_size_per_gpu = resolved.train_micro_batch_size_per_gpu
    cfg.gradient_accumulation_steps = resolved.gradient_accumulation_steps
    cfg._derived_batch_keys = resolved.derived
    cfg._ignored_keys = tuple(ignored)
    cfg._world_size = world_size
    cfg._elastic_world_sizes = elastic_world_sizes
    for caught in deprecations:
        warnings.warn(f"{source}: {caught.message}", ConfigWarning, stacklevel=2)
    if isinstance(elastic, ElasticityConfig) and given:
        warnings.warn(
            f"{source}: elasticity is enabled and ignore_non_elastic_batch_info is true, so "
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} ignored; elastic batch sizes at "
            f"world size {world_size}: {TBS} {resolved.train_batch_size}, {MICRO} "
            f"{resolved.train_micro_batch_size_per_gpu}, {GAS} {resolved.gradient_accumulation_steps}",
            ConfigWarning,
            stacklevel=2,
        )
    if ignored:
        warnings.warn(
            f"{source}: zengine accepts but ignores these DeepSpeed keys: {', '.join(ignored)}",
            ConfigWarning,
            stacklevel=2,
        )
    return cfg


ZERO_INIT_SECTIONS = ("zero_optimization", "aio", "fp16", "bf16")


def load_zero_sections(config: ConfigSource) -> ZengineConfig:
    """The sections ``zero.Init`` needs (``ZERO_INIT_SECTIONS``), validated alone: the rest of the config
    is the engine's to check at ``initialize`` (Hugging Face enters ``zero.Init`` with "auto" still in the
    optimizer and scheduler sections). A precision section whose ``enabled`` is "auto" is left out.
    Raises ``ConfigError`` listing the problems of those sections."""
    source, raw = _read(config)
    wanted = {
        key: raw[key]
        for key in ZERO_INIT_SECTIONS
        if key in raw and not (isinstance(raw[key], Mapping) and raw[key].get("enabled") == "auto")
    }
    try:
        return ZengineConfig.model_validate(wanted)
    except ValidationError as error:
        problems = _describe(error)
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ConfigError(
            f"invalid zengine config {source} for zero.Init ({count}):\n"
            + "\n".join(f"  {p}" for p in problems)
        ) from None


def _read(config: Any) -> Tuple[str, Dict[str, Any]]:
    """Return ``(a name for messages, a private copy of the raw dict)``."""
    if isinstance(config, Mapping):
        return "<dict>", copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"config must be a path to a JSON file or a dict, got {type(config).__name__}"
        )
    path = Path(os.fspath(config))
    if not path.exists():
        hint = (
            " (this looks like JSON text; pass json.loads(text) or a file path)"
            if str(config).lstrip().startswith("{")
            else ""
        )
        raise ConfigError(f"config file not found: {path}{hint}")
    if path.is_dir():
        raise ConfigError(f"config path is a directory, not a JSON file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from error
    if not text.strip():
        raise ConfigError(f"config file is empty: {path}")
    try:
        raw = _plain(hjson.loads(text, object_pairs_hook=_no_duplicate_keys, parse_float=_Decimal))
    except hjson.HjsonDecodeError as error:
        raise ConfigError(
            f"malformed JSON in {path} at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except _DuplicateKey as error:
        raise ConfigError(f"{path}: key {error.key!r} appears twice in the same object") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the config must be a JSON object ({{...}}), got a JSON {_json_kind(raw)}"
        )
    return str(path), raw


class _Decimal:
    """A number written with a fraction or an exponent, until ``_plain`` makes it a float.

    hjson turns an integral decimal into an int (2.0 -> 2), which would let ``"train_batch_size": 2.0``
    pass as an int; it does so when ``int(x) == x``, which never holds for this class."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __int__(self) -> int:
        return 0


def _plain(value: Any) -> Any:
    """``value`` with every ``_Decimal`` made a float, as ``json`` would have read it."""
    if isinstance(value, _Decimal):
        return float(value.text)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def load_section(name: str, value: Any) -> BaseModel:
    """Validate one top-level section on its own, with ``load_config``'s messages (the key paths
    start at the top level), and return its model. Raises ``ConfigError``."""
    if (
        name not in ZengineConfig.model_fields
        or _model_type(ZengineConfig.model_fields[name].annotation) is None
    ):
        raise ValueError(f"load_section: {name!r} is not a section of the config")
    try:
        cfg = ZengineConfig.model_validate({name: value})
    except ValidationError as error:
        problems = _describe(error)
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ConfigError(
            f"invalid {name} section ({count}):\n" + "\n".join(f"  {p}" for p in problems)
        ) from None
    return getattr(cfg, name)


def _elastic_section(
    cfg: Optional[ZengineConfig], raw: Dict[str, Any]
) -> Union[ElasticityConfig, bool, None]:
    """The enabled ``elasticity`` section; None when it is off; False when it says enabled but is invalid
    (its problems are reported already, and the batch keys cannot be resolved without it)."""
    if cfg is not None:
        return cfg.elasticity if cfg.elasticity.enabled else None
    section = raw.get("elasticity")
    if not isinstance(section, dict) or section.get("enabled") is not True:
        return None
    try:
        return ElasticityConfig.model_validate(section)
    except ValidationError:
        return False


def _batch_keys(
    cfg: Optional[ZengineConfig], raw: Dict[str, Any]
) -> Optional[Tuple[Optional[int], ...]]:
    """The three batch keys to resolve, or None when a type error was already reported for one."""
    if cfg is not None:
        return (
            cfg.train_batch_size,
            cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps,
        )
    values = []
    for key in (TBS, MICRO, GAS):
        value = raw.get(key)
        if value is None or value == "auto":
            values.append(None)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            values.append(value)
        else:
            return None
    return tuple(values)


def _precision_problem(raw: Dict[str, Any], found: List[str]) -> List[str]:
    """The fp16-and-bf16 check, which pydantic skips when any other field failed."""
    try:
        problem = precision_problem(
            FP16Config.model_validate(raw.get("fp16") or {}),
            BF16Config.model_validate(raw.get("bf16", raw.get("bfloat16")) or {}),
        )
    except ValidationError:
        return []
    return [problem] if problem and problem not in found else []


def _describe(error: ValidationError) -> List[str]:
    """One line per pydantic error, each starting with the full key path."""
    lines = []
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"])
        path = ".".join(loc)
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key{_suggest(loc[:-1], loc[-1])}")
        elif item["type"] == "missing":
            lines.append(f"{path}: required key is missing")
        elif item["type"] in ("value_error", "assertion_error") and "error" in item.get("ctx", {}):
            lines.extend(_keyed_lines(path, str(item["ctx"]["error"]), item.get("input")))
        else:
            lines.append(f"{path or 'config'}: {item['msg']}{_got(item)}")
    return lines


def _keyed_lines(path: str, message: str, value: Any) -> Iterator[str]:
    """The lines of a validator's message under ``path``; ``value`` is what the validator got,
    a line ``"key.path: text"`` is about the value at that relative key path."""
    for line in message.splitlines():
        match = _KEYED_LINE.match(line)
        if match:
            yield f"{_join(path, match.group(1))}: {match.group(2)}{_hint(_value_at(value, match.group(1)))}"
        else:
            yield f"{path or 'config'}: {line}{_hint(value)}"


def _value_at(value: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _hint(value: Any) -> str:
    """What a refused value probably means, for two values a person writes on purpose."""
    if isinstance(value, str) and value == "auto":
        return _AUTO_HINT
    if isinstance(value, str) and value.rstrip().endswith(","):
        return _UNQUOTED_HINT
    return ""


def _got(item: Dict[str, Any]) -> str:
    if "input" not in item:
        return ""
    value = item["input"]
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f" (got {text}){_hint(value)}"


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _model_at(loc: Tuple[str, ...]) -> Optional[Type[BaseModel]]:
    """The config model that holds the keys at dotted location ``loc``."""
    model: Optional[Type[BaseModel]] = ZengineConfig
    for part in loc:
        field = model.model_fields.get(part) if model else None
        model = _model_type(field.annotation) if field else None
    return model


def _model_type(annotation: Any) -> Optional[Type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_type(arg)
        if found:
            return found
    return None


def _known_paths(model: Type[BaseModel], prefix: Tuple[str, ...] = ()) -> Iterator[Tuple[str, ...]]:
    for name, field in model.model_fields.items():
        yield prefix + (name,)
        sub = _model_type(field.annotation)
        if sub:
            yield from _known_paths(sub, prefix + (name,))


def _suggest(parent: Tuple[str, ...], key: str) -> str:
    """``"; did you mean 'X'?"`` for a near miss, else ``""``."""
    elsewhere = [
        path for path in _known_paths(ZengineConfig) if path[-1] == key and path[:-1] != parent
    ]
    if elsewhere:
        return f"; did you mean {'.'.join(elsewhere[0])!r}?"
    model = _model_at(parent)
    candidates = list(model.model_fields) if model else []
    candidates += list(getattr(model, "DEPRECATED_KEYS", {}))
    candidates += unsupported_keys_under(".".join(parent))
    by_lower = {name.lower(): name for name in candidates}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {by_lower[close[0]]!r}?"
    if parent and parent[-1] in ("optimizer", "scheduler"):
        return f"; {parent[-1]} settings such as {key!r} go under '{_join(*parent)}.params'"
    return ""
