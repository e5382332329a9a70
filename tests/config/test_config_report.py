"""format_config: one aligned `key.path = value` line per setting, `*` on changed values."""

import warnings

from zengine.config import ZengineConfig, format_config, load_config


def _lines(config, world_size=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(config, world_size)
    text = format_config(cfg)
    rows = {}
    for line in text.splitlines():
        if " = " in line:
            key, value = line.split(" = ", 1)
            rows[key.strip()] = value
    return text, rows


def test_changed_values_are_marked():
    _, rows = _lines(
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "5e7"},
        }
    )
    assert rows["gradient_clipping"] == "1.0 *"
    assert rows["zero_optimization.stage"] == "2 *"
    assert rows["zero_optimization.reduce_bucket_size"] == "50000000 *"
    assert rows["zero_optimization.allgather_bucket_size"] == "500000000"
    assert rows["fp16.enabled"] == "false"
    assert rows["steps_per_print"] == "10"


def test_value_equal_to_default_is_not_marked():
    _, rows = _lines(
        {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10,
            "zero_optimization": {"reduce_bucket_size": "5e8"},
        }
    )
    assert rows["steps_per_print"] == "10"
    assert rows["zero_optimization.reduce_bucket_size"] == "500000000"


def test_stage_dependent_default_of_overlap_comm():
    _, rows = _lines({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}})
    assert rows["zero_optimization.overlap_comm"] == "true"
    _, rows = _lines(
        {
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 1, "overlap_comm": True},
        }
    )
    assert rows["zero_optimization.overlap_comm"] == "true *"


def test_batch_keys_given_or_derived():
    text, rows = _lines({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert rows["train_batch_size"] == "16 *"
    assert rows["train_micro_batch_size_per_gpu"] == "4 *"
    assert rows["gradient_accumulation_steps"] == "2 (derived)"
    assert "world size 2" in text


def test_optimizer_params_and_ignored_keys_are_listed(tmp_path):
    text, rows = _lines(
        {
            "train_micro_batch_size_per_gpu": 4,
            "comet": {"enabled": True},
            "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.99]}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            },
        }
    )
    assert rows["optimizer.type"] == '"AdamW" *'
    assert rows["optimizer.params.lr"] == "0.0003 *"
    assert rows["optimizer.params.betas"] == "[0.9, 0.99] *"
    assert rows["scheduler"] == "null"
    assert rows["zero_optimization.offload_param.nvme_path"] == f'"{tmp_path}" *'
    assert "ignored DeepSpeed keys: comet" in text


def test_lines_are_aligned_and_cover_every_field():
    text = format_config(ZengineConfig(train_micro_batch_size_per_gpu=1))
    rows = [line for line in text.splitlines() if " = " in line]
    assert len({line.index(" = ") for line in rows}) == 1
    assert any(line.startswith("aio.overlap_events") for line in rows)
    assert any(line.startswith("zero_optimization.stage3_debug_fetch_order") for line in rows)


def test_changed_only_lists_the_changes_and_counts_the_rest():
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2},
        },
        2,
    )
    full, short = (
        format_config(cfg).splitlines(),
        format_config(cfg, changed_only=True).splitlines(),
    )
    squeeze = lambda lines: [" ".join(line.split()) for line in lines]  # (alignment widths differ)
    assert squeeze(line for line in full if line.rstrip().endswith(("*", "(derived)"))) == squeeze(
        short[:-2]
    )
    assert any(line.startswith("zero_optimization.stage") for line in short)
    assert not any(line.startswith("fp16.enabled") for line in short)  # a default
    hidden = sum(1 for line in full if " = " in line) - sum(1 for line in short if " = " in line)
    assert (
        short[-2]
        == f"({hidden} more settings at their defaults; ZENGINE_PRINT_CONFIG=full logs every one)"
    )
