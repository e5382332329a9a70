"""DeepSpeed keys for features zengine lacks: refused when they change results, else named as ignored."""

import warnings

import pytest

from zengine.config import UNSUPPORTED_KEYS, ConfigError, ConfigWarning, ZengineConfig, load_config
from zengine.config.load import _known_paths
from zengine.config.unsupported import CHANGES_RESULTS, IGNORABLE

BASE = {"train_micro_batch_size_per_gpu": 2}


def _nest(path, value):
    config = dict(BASE)
    *parents, name = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[name] = value
    if path.startswith("zero_optimization.offload_optimizer"):
        config["zero_optimization"]["stage"] = 2
    if path.startswith("optimizer."):
        config["optimizer"]["type"] = "AdamW"
    return config


def _load(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, 1)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_table_is_consistent():
    paths = [entry.path for entry in UNSUPPORTED_KEYS]
    assert len(paths) == len(set(paths))
    implemented = {".".join(path) for path in _known_paths(ZengineConfig)}
    for entry in UNSUPPORTED_KEYS:
        assert entry.effect in (CHANGES_RESULTS, IGNORABLE)
        assert entry.path not in implemented, entry.path
        assert (entry.inert is not None) == (entry.effect == CHANGES_RESULTS), entry.path


@pytest.mark.parametrize("path", [e.path for e in UNSUPPORTED_KEYS if e.effect == IGNORABLE])
def test_ignorable_keys_are_accepted_and_named(path):
    cfg, notes = _load(_nest(path, {"enabled": True}))
    assert path in cfg.ignored_keys
    assert len(notes) == 1 and path in notes[0] and "ignores" in notes[0]


@pytest.mark.parametrize(
    "path,value",
    [
        ("amp", {"enabled": True, "opt_level": "O1"}),
        ("pipeline", {"stages": 2}),
        ("sparse_attention", {"mode": "fixed"}),
        ("curriculum_learning", {"enabled": True}),
        ("data_efficiency", {"enabled": True}),
        ("compression_training", {"weight_quantization": {}}),
        ("sparse_gradients", True),
        ("tensor_parallel", {"autotp_size": 2}),
        ("zero_optimization.zero_quantized_nontrainable_weights", True),
        ("managed_gradient_accumulation", False),
        ("checkpoint.use_node_local_storage", True),
    ],
)
def test_result_changing_keys_are_refused(path, value):
    with pytest.raises(ConfigError) as info:
        load_config(_nest(path, value), 1)
    message = str(info.value)
    assert (
        f"{path}: zengine does not implement DeepSpeed's" in message and "remove the key" in message
    )


@pytest.mark.parametrize(
    "path,value",
    [
        ("amp", {"enabled": False, "opt_level": "O1"}),
        ("curriculum_learning", {}),
        ("sparse_gradients", False),
        ("managed_gradient_accumulation", True),
    ],
)
def test_result_changing_keys_accepted_when_inert(path, value):
    cfg, notes = _load(_nest(path, value))
    expected = path.replace("bfloat16", "bf16")
    assert expected in cfg.ignored_keys and any(expected in note for note in notes)


def test_every_result_changing_key_is_inert_at_deepspeed_default():
    for entry in UNSUPPORTED_KEYS:
        if entry.effect == CHANGES_RESULTS:
            assert (
                entry.inert(None)
                or entry.inert({"enabled": False})
                or entry.inert(False)
                or entry.inert(1)
                or entry.inert(-1)
            ), entry.path


def test_refusal_hint_says_how_to_disable():
    with pytest.raises(ConfigError, match='set "enabled": false'):
        load_config(_nest("amp", {"enabled": True}), 1)
    with pytest.raises(ConfigError, match="set it to false"):
        load_config(_nest("sparse_gradients", True), 1)


def test_one_warning_names_every_ignored_key():
    config = {
        **BASE,
        "comet": {"enabled": True},
        "comms_logger": {"enabled": False},
        "flops_profiler": {},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 2,
            "round_robin_gradients": True,
            "ignore_unused_parameters": True,
        },
    }
    cfg, notes = _load(config)
    assert len(notes) == 1
    for key in (
        "comet",
        "comms_logger",
        "flops_profiler",
        "zero_allow_untested_optimizer",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.ignore_unused_parameters",
    ):
        assert key in notes[0] and key in cfg.ignored_keys


def test_checkpoint_tag_validation_read_as_deepspeed_reads_it():
    """DeepSpeed's checkpoint.tag_validation in any case; zengine always fails on different tags per rank."""
    cfg, _ = _load({**BASE, "checkpoint": {"tag_validation": "fail"}})
    assert cfg.checkpoint.tag_validation == "Fail"
    assert _load(dict(BASE))[0].checkpoint.tag_validation == "Warn"
    with pytest.raises(ConfigError, match="tag_validation"):
        load_config({**BASE, "checkpoint": {"tag_validation": "sometimes"}}, 1)
