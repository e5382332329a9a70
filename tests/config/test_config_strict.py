"""Strict JSON types in every field of every config model: a flag takes only true or false, an
integer key refuses a boolean and a decimal, a decimal key takes any number but a boolean. Also
``comm_timeout``, and that one config reports all its problems even when a deprecated key is
among them."""

import typing
import warnings

import pytest

from zengine.config import ConfigError, ZengineConfig, load_config
from zengine.config.load import _known_paths, _model_at
from zengine.config.base import _whole_number

BASE = {"train_micro_batch_size_per_gpu": 2}


def _leaf_fields():
    """``(dotted path, kind)`` of every bool, int and float field: kind is flag, integer, size or number."""
    for path in _known_paths(ZengineConfig):
        field = _model_at(path[:-1]).model_fields[path[-1]]
        annotation = field.annotation
        if typing.get_origin(annotation) is typing.Union:  # Optional[...], e.g. the batch keys
            inners = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(inners) > 1:  # a flag or "auto" (shared_memory.enabled): its own test below
                continue
            (inner,) = inners
            annotation = (
                typing.get_args(inner)[0] if typing.get_origin(inner) is typing.Annotated else inner
            )
        if annotation is bool:
            yield ".".join(path), "flag"
        elif annotation is int:
            sizes = any(getattr(m, "func", None) is _whole_number for m in field.metadata)
            yield ".".join(path), "size" if sizes else "integer"
        elif annotation is float:
            yield ".".join(path), "number"


FIELDS = sorted(_leaf_fields())


def _nest(path: str, value) -> dict:
    config = dict(BASE)
    node = config
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


def _error(config) -> str:
    with pytest.raises(ConfigError) as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(config, 1)
    return str(info.value)


def test_the_walk_finds_every_kind():
    kinds = dict(FIELDS)
    assert kinds["zero_optimization.stage"] == "integer" and kinds["fp16.enabled"] == "flag"
    assert kinds["train_batch_size"] == "integer" and kinds["gradient_clipping"] == "number"
    assert (
        kinds["zero_optimization.reduce_bucket_size"] == "size"
        and kinds["comm_timeout"] == "number"
    )


@pytest.mark.parametrize("path", [path for path, kind in FIELDS if kind == "flag"])
@pytest.mark.parametrize("value", [1, 0, "true", "yes"])
def test_flags_take_only_true_or_false(path, value):
    assert f"\n  {path}: Input should be a valid boolean (got {value!r})" in _error(
        _nest(path, value)
    )


@pytest.mark.parametrize("path", [path for path, kind in FIELDS if kind != "flag"])
@pytest.mark.parametrize("value", [True, False])
def test_numbers_refuse_booleans(path, value):
    assert f"\n  {path}: expected " in _error(_nest(path, value))


@pytest.mark.parametrize("path", [path for path, kind in FIELDS if kind == "integer"])
@pytest.mark.parametrize("value", [2.0, 2.5, "2.0"])
def test_integers_refuse_decimals(path, value):
    assert f"\n  {path}: " in _error(_nest(path, value))


@pytest.mark.parametrize("path", [path for path, kind in FIELDS if kind == "number"])
def test_decimals_take_ints(path):
    cfg = load_config(_nest(path, 1), 1)
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    assert value == 1.0 and isinstance(value, float)


@pytest.mark.parametrize(
    "config,line",
    [
        (
            {**BASE, "zero_optimization": {"stage": True}},
            "zero_optimization.stage: expected an integer, not a boolean",
        ),
        ({**BASE, "fp16": {"enabled": 1}}, "fp16.enabled: Input should be a valid boolean (got 1)"),
        (
            {"train_batch_size": 2.0},
            "train_batch_size: expected an integer, not a decimal number (2.0)",
        ),
        (
            {**BASE, "gradient_clipping": True},
            "gradient_clipping: expected a number, not a boolean",
        ),
    ],
)
def test_the_issue_examples_are_refused_by_key_path(config, line):
    assert line in _error(config)


def test_an_int_clipping_is_accepted():
    cfg = load_config({**BASE, "gradient_clipping": 1}, 1)
    assert cfg.gradient_clipping == 1.0 and isinstance(cfg.gradient_clipping, float)


def test_numbers_written_as_strings_read_as_before():
    cfg = load_config(
        {
            **BASE,
            "zero_optimization": {"stage": "2", "reduce_bucket_size": "5e7"},
            "gradient_clipping": "0.5",
        },
        1,
    )
    assert (
        cfg.zero_optimization.stage,
        cfg.zero_optimization.reduce_bucket_size,
        cfg.gradient_clipping,
    ) == (2, 50_000_000, 0.5)


def test_comm_timeout():
    assert load_config(BASE, 1).comm_timeout == 300.0 == ZengineConfig().comm_timeout
    assert load_config({**BASE, "comm_timeout": 1800}, 1).comm_timeout == 1800.0
    assert load_config({**BASE, "comm_timeout": 0.5}, 1).comm_timeout == 0.5
    for value in (-1, 0, True, "never", float("inf")):
        assert "\n  comm_timeout: " in _error({**BASE, "comm_timeout": value}), value
    assert "seconds" in ZengineConfig.model_fields["comm_timeout"].description


def test_deprecated_keys_do_not_hide_other_problems():
    message = _error(
        {
            **BASE,
            "bfloat16": {"enabled": True},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": True, "cpu_offload": 1, "reduce_bucket_size": -1},
            "fp16": {"enabled": 1},
        }
    )
    assert "(5 problems)" in message
    for line in (
        "bfloat16: deprecated spelling of 'bf16'; give only one of them",
        "zero_optimization.cpu_offload: expected true or false, got 1",
        "zero_optimization.stage: expected an integer, not a boolean",
        "zero_optimization.reduce_bucket_size:",
        "fp16.enabled:",
    ):
        assert f"\n  {line}" in message, line


def test_a_flag_or_auto_takes_those_three_only():
    for value in (True, False, "auto"):
        assert (
            load_config({**BASE, "shared_memory": {"enabled": value}}, 1).shared_memory.enabled
            == value
        )
    assert ZengineConfig().shared_memory.enabled == "auto"
    for value in (1, "yes", "on", None):
        assert "\n  shared_memory.enabled: " in _error(
            {**BASE, "shared_memory": {"enabled": value}}
        ), value
