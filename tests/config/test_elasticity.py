"""The elasticity section: one global batch size chosen for many world sizes, split at the run's world size.

Expected values are worked by hand in the comments. "B usable at g" means B = m * g * k for a micro batch
m and a whole k >= 1, i.e. m * g divides B for some m.
"""

import time
import warnings

import pytest
import torch
from torch import nn

import zengine
from harness import spawn
from zengine.config import ConfigError, ConfigWarning, format_config, load_config
from zengine.elasticity import (
    ElasticityConfigError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elastic_batch_size,
    elastic_micro_batch,
    elasticity_enabled,
)

TBS, MICRO, GAS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)
# micro [2, 4], at most 32, 1..8 ranks. 4g | B implies 2g | B, so B is usable at g iff g divides B/2, with
# B/2 <= 16 and g <= 8. Divisors <= 8 of B/2: 6 -> 1,2,3,6 (4); 8 -> 1,2,4,8 (4); 12 -> 1,2,3,4,6 (5);
# 16 -> 1,2,4,8 (4); every other B/2 <= 16 has fewer. So B = 2 * 12 = 24, usable at 1, 2, 3, 4, 6.
ELASTIC = {
    "enabled": True,
    "max_train_batch_size": 32,
    "micro_batch_sizes": [2, 4],
    "min_gpus": 1,
    "max_gpus": 8,
}


def _ds(**overrides):
    return {"elasticity": {**ELASTIC, **overrides}}


def _sizes(cfg):
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


def test_hand_worked_batch_size_and_world_sizes():
    assert compute_elastic_config(_ds()) == (24, [1, 2, 3, 4, 6])


def test_ties_follow_prefer_larger_batch():
    # micro [1], at most 3, 1..3 ranks: B=1 usable at {1}, B=2 at {1,2}, B=3 at {1,3}: 2 and 3 tie.
    assert elastic_batch_size(3, [1], 1, 3, prefer_larger_batch=True) == (3, [1, 3])
    assert elastic_batch_size(3, [1], 1, 3, prefer_larger_batch=False) == (2, [1, 2])


def test_version_02_counts_whole_nodes_only():
    # micro [1], at most 32, 1..16 ranks, 4 per node. Version 0.2 counts g in {4, 8, 12, 16}, usable when
    # g | B: B=16 -> 4,8,16; B=24 -> 4,8,12; B=32 -> 4,8,16 (3 each, no B <= 32 has all four: lcm is 48).
    ds = {
        "enabled": True,
        "max_train_batch_size": 32,
        "micro_batch_sizes": [1],
        "min_gpus": 1,
        "max_gpus": 16,
        "num_gpus_per_node": 4,
    }
    assert compute_elastic_config({"elasticity": ds}) == (32, [4, 8, 16])
    assert compute_elastic_config({"elasticity": {**ds, "prefer_larger_batch": False}}) == (
        16,
        [4, 8, 16],
    )
    # Version 0.1 counts every g in 1..16: B=24 -> 1,2,3,4,6,8,12 and B=30 -> 1,2,3,5,6,10,15 (7 each; 12
    # has 6, 16/18/20/28/32 have 5): the larger, 30, wins.
    assert compute_elastic_config({"elasticity": {**ds, "version": 0.1}}) == (
        30,
        [1, 2, 3, 5, 6, 10, 15],
    )


def test_min_and_max_gpus_bound_the_world_sizes():
    # micro [1], at most 12, 3..4 ranks: B=12 is the only B <= 12 usable at both 3 and 4.
    assert elastic_batch_size(12, [1], 3, 4) == (12, [3, 4])


@pytest.mark.parametrize(
    "world,micro,gas",
    [
        (1, 4, 6),  # 24 = 4 * 1 * 6
        (2, 4, 3),  # 24 = 4 * 2 * 3
        (3, 4, 2),  # 24 = 4 * 3 * 2
        (4, 2, 3),  # 4 * 4 = 16 does not divide 24; 2 * 4 = 8 does: 24 = 2 * 4 * 3
        (6, 4, 1),  # 24 = 4 * 6 * 1
    ],
)
def test_micro_batch_and_accumulation_at_each_world_size(world, micro, gas):
    assert compute_elastic_config(_ds(), world_size=world) == (24, [1, 2, 3, 4, 6], micro)
    assert elastic_micro_batch(24, [2, 4], world) == (micro, gas)
    cfg = load_config(_ds(), world)
    assert _sizes(cfg) == (24, micro, gas)
    assert cfg.derived_batch_keys == (TBS, MICRO, GAS) and cfg.elastic_world_sizes == (
        1,
        2,
        3,
        4,
        6,
    )
    assert "(elasticity: global batch 24 suits world sizes 1, 2, 3, 4, 6)" in format_config(cfg)


def test_invalid_world_size_names_it_and_the_valid_ones():
    with pytest.raises(ElasticityIncompatibleWorldSize) as info:
        compute_elastic_config(_ds(), world_size=5)
    message = str(info.value)
    assert "world size 5" in message and "1, 2, 3, 4, 6" in message and "nearest: 4, 6" in message
    with pytest.raises(
        ConfigError, match=r"elasticity: world size 5 .* 1, 2, 3, 4, 6; start the job on one"
    ):
        load_config(_ds(), 5)


def test_world_size_outside_range_is_refused_even_if_it_divides():
    # B = 24 splits over 8 ranks only with micro 3 or 1, which are not listed: 8 is not valid. With
    # max_gpus 4, 6 ranks would divide 24 (micro 4) but lie outside the range.
    with pytest.raises(ConfigError, match="world size 8"):
        load_config(_ds(), 8)
    assert compute_elastic_config(_ds(max_gpus=4)) == (
        24,
        [1, 2, 3, 4],
    )  # 12 still has 1,2,3,4 under 4
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 6"):
        compute_elastic_config(_ds(max_gpus=4), world_size=6)


def test_long_lists_of_world_sizes_are_abbreviated():
    with pytest.raises(ElasticityIncompatibleWorldSize) as info:
        compute_elastic_config(
            {
                "elasticity": {
                    "enabled": True,
                    "max_train_batch_size": 5040,
                    "micro_batch_sizes": [1],
                    "max_gpus": 5040,
                }
            },
            world_size=11,
        )
    # 5040 = 7! has 60 divisors, the most of any number <= 5040 (a highly composite number).
    assert "(60 in all)" in str(info.value) and "..." in str(info.value)


@pytest.mark.parametrize("keys", [{TBS: 24}, {MICRO: 4, GAS: 3}])
def test_batch_keys_beside_elasticity_are_refused_by_name(keys):
    with pytest.raises(ConfigError) as info:
        load_config({**_ds(), **keys}, 2)
    for key in keys:
        assert f"{key}: set while elasticity is enabled" in str(info.value)
    assert "ignore_non_elastic_batch_info" in str(info.value)


def test_ignore_non_elastic_batch_info_drops_them_with_a_warning():
    config = {"elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True}, TBS: 7, MICRO: 7}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, 2)
    assert _sizes(cfg) == (24, 4, 3)
    notes = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert len(notes) == 1 and f"{TBS}, {MICRO} are ignored" in notes[0]


def test_auto_batch_keys_are_not_a_conflict():
    assert _sizes(load_config({**_ds(), TBS: "auto", MICRO: "auto", GAS: "auto"}, 4)) == (24, 2, 3)


def test_disabled_section_leaves_the_batch_keys_alone():
    cfg = load_config({"elasticity": {**ELASTIC, "enabled": False}, MICRO: 3}, 2)
    assert _sizes(cfg) == (6, 3, 1) and cfg.elastic_world_sizes == ()
    # Disabled, the section is inert: only its types are checked, as DeepSpeed does not read it either.
    assert _sizes(
        load_config({"elasticity": {"enabled": False, "model_parallel_size": 2}, MICRO: 3}, 1)
    ) == (3, 3, 1)
    assert elasticity_enabled(_ds()) and not elasticity_enabled({"elasticity": {"enabled": False}})
    with pytest.raises(ElasticityConfigError, match="not enabled"):
        compute_elastic_config({"elasticity": {"enabled": False}})


def test_model_parallel_size_other_than_one_is_refused():
    with pytest.raises(
        ConfigError, match="elasticity.model_parallel_size: zengine has no model parallelism"
    ):
        load_config(_ds(model_parallel_size=2), 1)
    with pytest.raises(ElasticityConfigError, match="model_parallel_size"):
        compute_elastic_config(_ds(model_parallel_size=2))


@pytest.mark.parametrize(
    "section,expected",
    [
        (
            {"enabled": True},
            [
                "elasticity.max_train_batch_size: required when elasticity is enabled",
                "elasticity.micro_batch_sizes: required when elasticity is enabled",
            ],
        ),
        ({**ELASTIC, "max_gpu": 4}, ["elasticity.max_gpu: unknown key; did you mean 'max_gpus'?"]),
        ({**ELASTIC, "micro_batch_sizes": []}, ["elasticity.micro_batch_sizes: list at least one"]),
        ({**ELASTIC, "micro_batch_sizes": [2, 0]}, ["elasticity.micro_batch_sizes.1:"]),
        (
            {**ELASTIC, "micro_batch_sizes": [64]},
            ["elasticity.micro_batch_sizes: [64] exceed max_train_batch_size"],
        ),
        (
            {**ELASTIC, "min_gpus": 4, "max_gpus": 2},
            ["elasticity.max_gpus: 2 is less than min_gpus 4"],
        ),
        (
            {**ELASTIC, "version": 0.3},
            ["elasticity.version: zengine implements elasticity versions up to 0.2"],
        ),
        ({**ELASTIC, "max_train_batch_size": 32.0}, ["elasticity.max_train_batch_size:"]),
    ],
)
def test_invalid_sections_are_refused_by_key_path(section, expected):
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": section}, 1)
    for text in expected:
        assert text in str(info.value)
    assert f"give {TBS}" not in str(
        info.value
    )  # no spurious batch-key problem next to the real one


def test_min_time_and_target_version_are_accepted():
    assert compute_elastic_config(_ds(min_time=20), target_deepspeed_version="0.14.0") == (
        24,
        [1, 2, 3, 4, 6],
    )


def test_return_microbatch_reads_the_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert compute_elastic_config(_ds(), return_microbatch=True) == (24, [1, 2, 3, 4, 6], 2)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(_ds(), return_microbatch=True)


def test_no_usable_batch_size_is_explained():
    # 8 per node, but at most 4 ranks: no world size counts.
    with pytest.raises(ConfigError, match="no batch size up to max_train_batch_size 32"):
        load_config(_ds(num_gpus_per_node=8, max_gpus=4), 1)


def test_large_search_is_fast():
    start = time.perf_counter()
    batch, valid = elastic_batch_size(
        50_000, [1, 2, 3, 4, 6, 8], 1, 10_000, prefer_larger_batch=True
    )
    assert time.perf_counter() - start < 5
    # 45360 = 2^4 * 3^4 * 5 * 7 has 100 divisors, the most of any number <= 50000; the 4 above 10000
    # (45360, 22680, 15120, 11340) are out of range, so 96 world sizes remain.
    assert batch == 45_360 and len(valid) == 96 and valid[-1] == 9072


def test_reachable_as_deepspeed_elasticity():
    assert zengine.elasticity.compute_elastic_config is compute_elastic_config


def _train_elastic(steps):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    config = {
        "elasticity": ELASTIC,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zengine.initialize(model=model, config=config)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 4)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
        engine.global_steps,
        engine.global_samples,
    )


@pytest.mark.parametrize("world,micro,gas", [(2, 4, 3), (4, 2, 3)])
def test_engine_trains_with_the_elastic_batch_at_each_world_size(world, micro, gas):
    results = spawn(_train_elastic, world, 2)
    # The same global batch, 24, at both sizes: 4 * 2 * 3 and 2 * 4 * 3; two optimizer steps, 48 samples.
    assert results == [(24, micro, gas, 2, 48)] * world
