"""The batch rule: train_batch_size = micro * accumulation * world size, any two imply the third."""

import pytest

from zengine.config import ConfigError, load_config, resolve_batch_sizes

TBS, MICRO, GAS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)
WORLDS = [1, 2, 3, 4]


def _load(world, **batch):
    cfg = load_config(batch, world)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize("world", WORLDS)
def test_all_three_consistent(world):
    assert _load(world, **{TBS: 8 * 2 * world, MICRO: 8, GAS: 2}) == (16 * world, 8, 2)


@pytest.mark.parametrize("world", WORLDS)
def test_micro_and_gas_imply_total(world):
    assert _load(world, **{MICRO: 4, GAS: 3}) == (12 * world, 4, 3)
    assert load_config({MICRO: 4, GAS: 3}, world).derived_batch_keys == (TBS,)


@pytest.mark.parametrize("world", WORLDS)
def test_total_and_micro_imply_gas(world):
    assert _load(world, **{TBS: 24 * world, MICRO: 4}) == (24 * world, 4, 6)


@pytest.mark.parametrize("world", WORLDS)
def test_total_and_gas_imply_micro(world):
    assert _load(world, **{TBS: 24 * world, GAS: 2}) == (24 * world, 12, 2)


@pytest.mark.parametrize("world", WORLDS)
def test_total_alone_means_one_step(world):
    assert _load(world, **{TBS: 12 * world}) == (12 * world, 12, 1)
    assert load_config({TBS: 12 * world}, world).derived_batch_keys == (MICRO, GAS)


@pytest.mark.parametrize("world", WORLDS)
def test_micro_alone_means_one_step(world):
    assert _load(world, **{MICRO: 5}) == (5 * world, 5, 1)


@pytest.mark.parametrize("world", WORLDS)
def test_auto_means_not_given(world):
    assert _load(world, **{TBS: "auto", MICRO: 2, GAS: "auto"}) == (2 * world, 2, 1)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_inconsistent_three_shows_arithmetic(world):
    with pytest.raises(ConfigError) as info:
        load_config({TBS: 7, MICRO: 2, GAS: 1}, world)
    message = str(info.value)
    assert f"{TBS}: 7 != {MICRO} 2 * {GAS} 1 * world size {world} = {2 * world}" in message


@pytest.mark.parametrize("world", [2, 3, 4])
def test_total_not_divisible_by_world(world):
    with pytest.raises(ConfigError) as info:
        load_config({TBS: world * 4 + 1}, world)
    assert f"world size {world}" in str(info.value) and "not divisible" in str(info.value)
    assert MICRO in str(info.value)


def test_total_not_divisible_by_micro():
    with pytest.raises(
        ConfigError, match=rf"{TBS}: 30 is not divisible by {MICRO} 4 \* world size 2 = 8"
    ):
        load_config({TBS: 30, MICRO: 4}, 2)


def test_gas_alone_is_an_error():
    with pytest.raises(ConfigError) as info:
        load_config({GAS: 4}, 1)
    assert TBS in str(info.value) and MICRO in str(info.value) and f"only {GAS}" in str(info.value)


def test_nothing_given_names_the_keys():
    with pytest.raises(ConfigError) as info:
        load_config({}, 1)
    assert TBS in str(info.value) and MICRO in str(info.value)


@pytest.mark.parametrize("value", [0, -1, 2.5, "x", True])
def test_bad_batch_values(value):
    with pytest.raises(ConfigError, match=MICRO):
        load_config({MICRO: value}, 1)


def test_world_size_must_be_positive_int():
    for world in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="world_size"):
            load_config({MICRO: 1}, world)


def test_pure_function():
    assert resolve_batch_sizes(None, 2, 2, 3)[:3] == (12, 2, 2)
    with pytest.raises(ValueError):
        resolve_batch_sizes(None, None, None, 1)
