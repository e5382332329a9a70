"""load_config: reading files, one ConfigError naming every problem by key path, aliases."""

import json
import warnings
from pathlib import Path

import pytest

from zengine.config import ConfigError, ConfigWarning, load_config

REPO = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2}


def _error(config, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size)
    return str(info.value)


def _with(**sections):
    return {**BASE, **sections}


# -- reading --------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    assert str(path) in _error(path)
    assert "not found" in _error(str(path))


def test_json_text_instead_of_path_gets_a_hint():
    assert "looks like JSON text" in _error('{"train_batch_size": 8}')


def test_directory_is_rejected(tmp_path):
    message = _error(tmp_path)
    assert "directory" in message and str(tmp_path) in message


def test_malformed_json_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled" true}\n}\n')
    message = _error(path)
    assert str(path) in message and "line 3, column 22" in message


def test_duplicate_keys_are_rejected(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "'train_batch_size' appears twice" in _error(path)


@pytest.mark.parametrize(
    "text,kind", [("[1, 2]", "array"), ('"zero2"', "string"), ("3", "number"), ("null", "null")]
)
def test_config_must_be_an_object(tmp_path, text, kind):
    path = tmp_path / "c.json"
    path.write_text(text)
    message = _error(path)
    assert "JSON object" in message and kind in message


@pytest.mark.parametrize("config", [42, ["train_batch_size"], None])
def test_config_must_be_path_or_dict(config):
    assert "path to a JSON file or a dict" in _error(config)


def test_file_and_pathlike_load(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(_with(zero_optimization={"stage": 2})))
    assert load_config(path, 2).zero_optimization.stage == 2
    assert load_config(str(path), 2).train_batch_size == 4


def test_dict_is_not_modified():
    config = _with(
        bfloat16={"enabled": True},
        comet={"enabled": True},
        zero_optimization={"cpu_offload": True, "stage": 2},
    )
    before = json.dumps(config, sort_keys=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(config, 1)
    assert json.dumps(config, sort_keys=True) == before


@pytest.mark.parametrize("name", ["zero0.json", "zero1.json", "zero2.json", "zero3.json"])
def test_shipped_stage_configs(name):
    cfg = load_config(REPO / "configs" / name, 2)
    assert cfg.zero_optimization.stage == int(name[4])
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (16, 1)
    assert (
        cfg.zero_optimization.reduce_bucket_size == 5_000_000
    )  # ~DDP's 25 MB buckets: overlap on small models
    assert cfg.optimizer.type == "AdamW" and cfg.scheduler.type == "WarmupLR"


def test_every_file_in_configs_loads():
    files = sorted((REPO / "configs").glob("*.json"))
    assert files
    for path in files:
        load_config(path, 1)


# -- unknown keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config,expected",
    [
        (
            _with(zero_optimizaton={"stage": 1}),
            "zero_optimizaton: unknown key; did you mean 'zero_optimization'?",
        ),
        (
            _with(gradient_cliping=1.0),
            "gradient_cliping: unknown key; did you mean 'gradient_clipping'?",
        ),
        (
            _with(zero_optimization={"reduce_bucket_sise": 5}),
            "zero_optimization.reduce_bucket_sise: unknown key; did you mean 'reduce_bucket_size'?",
        ),
        (
            _with(
                zero_optimization={
                    "stage": 3,
                    "offload_param": {"device": "cpu", "pin_memroy": True},
                }
            ),
            "zero_optimization.offload_param.pin_memroy: unknown key; did you mean 'pin_memory'?",
        ),
        (
            _with(fp16={"enabled": True, "loss_scale_windows": 10}),
            "fp16.loss_scale_windows: unknown key; did you mean 'loss_scale_window'?",
        ),
        (_with(aio={"queue_dept": 4}), "aio.queue_dept: unknown key; did you mean 'queue_depth'?"),
        (_with(stage=2), "stage: unknown key; did you mean 'zero_optimization.stage'?"),
        (
            _with(tensorbord={"enabled": False}),
            "tensorbord: unknown key; did you mean 'tensorboard'?",
        ),
        (_with(optimizer={"tpye": "Adam"}), "optimizer.tpye: unknown key; did you mean 'type'?"),
        (
            _with(optimizer={"type": "Adam", "lr": 1e-3}),
            "optimizer.lr: unknown key; optimizer settings such as "
            "'lr' go under 'optimizer.params'",
        ),
        (_with(frobnicate=1), "frobnicate: unknown key"),
    ],
)
def test_unknown_keys_are_named_with_suggestion(config, expected):
    assert expected in _error(config)


# -- types and ranges -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config,path",
    [
        (
            _with(zero_optimization={"stage": 4}),
            "zero_optimization.stage: Input should be less than or equal to 3",
        ),
        (
            _with(zero_optimization={"reduce_bucket_size": -1}),
            "zero_optimization.reduce_bucket_size:",
        ),
        (
            _with(zero_optimization={"allgather_bucket_size": "5.5"}),
            "zero_optimization.allgather_bucket_size:",
        ),
        (
            _with(zero_optimization={"stage": 3, "offload_param": {"buffer_size": -5}}),
            "zero_optimization.offload_param.buffer_size:",
        ),
        (
            _with(fp16={"hysteresis": 0}),
            "fp16.hysteresis: Input should be greater than or equal to 1",
        ),
        (_with(fp16={"loss_scale": -1}), "fp16.loss_scale:"),
        (_with(fp16={"min_loss_scale": 0}), "fp16.min_loss_scale:"),
        (_with(gradient_clipping=-0.5), "gradient_clipping:"),
        (_with(steps_per_print=0), "steps_per_print:"),
        (_with(wall_clock_breakdown="sometimes"), "wall_clock_breakdown:"),
        (_with(aio={"block_size": 0}), "aio.block_size:"),
        (
            _with(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
            "zero_optimization.offload_optimizer.device: Input should be 'none', 'cpu' or 'nvme'",
        ),
        (_with(zero_optimization=[1]), "zero_optimization:"),
        (_with(optimizer="Adam"), "optimizer:"),
    ],
)
def test_wrong_types_and_ranges_name_the_key(config, path):
    assert path in _error(config)


def test_auto_outside_batch_keys_explains_itself():
    message = _error(_with(fp16={"enabled": "auto"}, gradient_clipping="auto"))
    assert "fp16.enabled:" in message and "gradient_clipping:" in message
    assert message.count("Hugging Face Trainer") == 2


# Hugging Face's documented ZeRO-3 config with offload, as its docs print it: the Trainer fills the
# "auto" values only after the model is built, so zero.Init sees them as they are here.
HF_ZERO3 = json.loads((REPO / "tests" / "fixtures" / "hf" / "ds_config_zero3.json").read_text())


def test_auto_in_the_zero_section_takes_deepspeeds_default_at_zero_init():
    """As DeepSpeed's config models do: an "auto" ZeRO or offload key is as if not given."""
    from zengine.config.load import load_zero_sections
    from zengine.config.zero import ZeroConfig

    zero = load_zero_sections(HF_ZERO3).zero_optimization
    default = ZeroConfig(stage=3)
    assert zero.stage == 3 and zero.offload_param.device == "cpu"
    assert zero.reduce_bucket_size == default.reduce_bucket_size
    assert zero.stage3_prefetch_bucket_size == default.stage3_prefetch_bucket_size
    assert zero.stage3_param_persistence_threshold == default.stage3_param_persistence_threshold
    offload = load_zero_sections(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu", "buffer_count": "auto"},
            }
        }
    ).zero_optimization.offload_param
    assert offload.buffer_count == 5
    # a key whose own values include "auto" keeps it (shared_memory.enabled is not a ZeRO key, but the
    # ZeRO section's stage is not "auto"-able: refused by name)
    assert "zero_optimization.stage" in _error(_with(zero_optimization={"stage": "auto"}))


def test_auto_zero_keys_and_sub_group_size_zero_at_initialize():
    """A script that hands deepspeed.initialize the documented config with its batch, optimizer and
    precision keys filled, the ZeRO "auto" keys left: DeepSpeed's defaults, no error."""
    cfg = dict(
        HF_ZERO3,
        gradient_clipping=1.0,
        fp16={"enabled": False},
        train_batch_size=4,
        optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 1}},
    )
    cfg["zero_optimization"] = dict(
        cfg["zero_optimization"], sub_group_size=0, stage3_max_live_parameters="auto"
    )
    loaded = _quiet_load(cfg)[0]
    assert loaded.zero_optimization.reduce_bucket_size == 500_000_000
    assert loaded.zero_optimization.sub_group_size == 1_000_000_000
    assert loaded.zero_optimization.stage3_max_live_parameters == 1_000_000_000


def test_dotted_top_level_keys_are_ignored_as_deepspeed_ignores_them():
    """TRL's prepare_deepspeed adds "zero_optimization.reduce_bucket_size" (and two more) at the top
    level; DeepSpeed never reads them. zengine says so and keeps the nested values."""
    cfg = _with(zero_optimization={"stage": 3, "reduce_bucket_size": 1000})
    cfg["zero_optimization.reduce_bucket_size"] = 64 * 64
    cfg["zero_optimization.stage3_prefetch_bucket_size"] = 0.9 * 64 * 64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(cfg, 1)
    assert loaded.zero_optimization.reduce_bucket_size == 1000
    message = " ".join(str(w.message) for w in caught)
    assert '"zero_optimization.reduce_bucket_size" (a top-level key' in message
    assert '"zero_optimization.reduce_bucket_size" (a top-level key' in " ".join(
        loaded.ignored_keys
    )
    # a dotted key that names no section is still an unknown key
    assert "unknown key" in _error(_with(**{"zero_optimisation.stage": 2}))


def test_unknown_optimizer_and_scheduler_types():
    message = _error(_with(optimizer={"type": "adamww"}, scheduler={"type": "WarmupCosine"}))
    assert "optimizer.type: 'adamww' is not an optimizer zengine can build" in message
    assert "did you mean 'AdamW'?" in message
    assert (
        "scheduler.type: 'WarmupCosine' is not a scheduler" in message
        and "'WarmupCosineLR'" in message
    )
    assert "DeepSpeed optimizer that zengine does not implement" in _error(
        _with(optimizer={"type": "Lamb"})
    )


# -- combinations ---------------------------------------------------------------------------------


def test_fp16_and_bf16_together():
    assert "fp16.enabled: fp16 and bf16 are both enabled" in _error(
        _with(fp16={"enabled": True}, bf16={"enabled": True})
    )


def test_fp16_and_bf16_reported_even_with_other_errors():
    message = _error(_with(fp16={"enabled": True}, bfloat16={"enabled": True}, steps_per_print=-1))
    assert "fp16 and bf16 are both enabled" in message and "steps_per_print:" in message


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_offload_needs_stage_3(stage):
    message = _error(_with(zero_optimization={"stage": stage, "offload_param": {"device": "cpu"}}))
    assert (
        f"zero_optimization.offload_param.device: parameter offload ('cpu') needs stage 3; stage is {stage}"
        in message
    )


def test_optimizer_offload_needs_a_stage():
    message = _error(_with(zero_optimization={"offload_optimizer": {"device": "cpu"}}))
    assert "zero_optimization.offload_optimizer.device:" in message and "stage is 0" in message
    load_config(_with(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}), 1)


def test_nvme_needs_a_path(tmp_path):
    message = _error(
        _with(
            zero_optimization={
                "stage": 3,
                "offload_optimizer": {"device": "nvme"},
                "offload_param": {"device": "nvme"},
            }
        )
    )
    assert "zero_optimization.offload_optimizer.nvme_path:" in message
    assert "zero_optimization.offload_param.nvme_path:" in message
    cfg = load_config(
        _with(
            zero_optimization={
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            }
        ),
        1,
    )
    assert cfg.zero_optimization.offload_param.nvme_path == tmp_path


def test_all_problems_in_one_message():
    message = _error(
        {
            "train_batch_size": 30,
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {
                "stage": 1,
                "reduce_bucket_size": -5,
                "offload_param": {"device": "cpu"},
            },
            "fp16": {"hysteresis": 0},
            "amp": {"enabled": True},
            "tensorbord": {},
        },
        world_size=2,
    )
    lines = message.splitlines()
    assert lines[0].startswith("invalid zengine config <dict> (")
    for path in (
        "amp:",
        "fp16.hysteresis:",
        "zero_optimization.reduce_bucket_size:",
        "tensorbord:",
        "train_batch_size:",
    ):
        assert sum(line.strip().startswith(path) for line in lines) == 1, path


# -- DeepSpeed aliases ----------------------------------------------------------------------------


def _quiet_load(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, 1)
    return cfg, [str(w.message) for w in caught]


def test_bfloat16_alias():
    cfg, notes = _quiet_load(_with(bfloat16={"enabled": True}))
    assert cfg.bf16.enabled and any("bfloat16 is deprecated" in note for note in notes)
    assert "give only one" in _error(_with(bfloat16={"enabled": True}, bf16={"enabled": True}))


def test_gather_fp16_alias():
    cfg, _ = _quiet_load(
        _with(zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True})
    )
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_cpu_offload_alias():
    cfg, _ = _quiet_load(_with(zero_optimization={"stage": 2, "cpu_offload": True}))
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    cfg, _ = _quiet_load(_with(zero_optimization={"stage": 2, "cpu_offload": False}))
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    cfg, _ = _quiet_load(_with(zero_optimization={"stage": 3, "cpu_offload_param": True}))
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert "give only one" in _error(
        _with(
            zero_optimization={
                "stage": 2,
                "cpu_offload": True,
                "offload_optimizer": {"device": "cpu"},
            }
        )
    )


def test_legacy_boolean_zero_and_null_sections():
    cfg, _ = _quiet_load(_with(zero_optimization=True, fp16=None, scheduler=None))
    assert cfg.zero_optimization.stage == 1 and cfg.fp16.enabled is False and cfg.scheduler is None
    cfg, _ = _quiet_load(_with(zero_optimization={"stage": 3, "offload_param": None}))
    assert cfg.zero_optimization.offload_param.device == "none"


def test_hugging_face_style_config():
    cfg, _ = _quiet_load(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": "auto",
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 2,
                "allgather_bucket_size": 2e8,
                "reduce_bucket_size": "2e8",
                "overlap_comm": True,
            },
        }
    )
    assert (cfg.train_batch_size, cfg.zero_optimization.allgather_bucket_size) == (4, 200_000_000)


def test_no_warning_for_a_clean_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(REPO / "configs" / "zero3.json", 1)


def test_warning_category():
    with pytest.warns(ConfigWarning, match="comet"):
        load_config(_with(comet={"enabled": True}), 1)


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.json"))
)
def test_shipped_configs_load(name):
    """Every config in configs/ is valid as shipped, and asks for what its name says."""
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / name), world_size=2)
    assert cfg.zero_optimization.stage == int(name[4])  # zero<stage>...json
    if "nvme" in name:
        assert cfg.zero_optimization.offload_optimizer.device == "nvme"
        assert cfg.zero_optimization.offload_param.device == "cpu"
