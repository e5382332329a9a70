"""The learning-rate schedules against DeepSpeed's formulas, written out independently here.

``lrs[k]`` below is the lr in the param group after k calls to step(), i.e. at
``last_batch_iteration = k - 1``; ``lrs[0]`` is the value set at construction.
"""

import json
import math
import types
import warnings
from pathlib import Path

import pytest
import torch

from zengine.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def groups(*lrs, **extra):
    """A plain object with param_groups, as the engine's wrapper would present them."""
    return types.SimpleNamespace(param_groups=[{"lr": lr, **extra} for lr in lrs])


def run(schedule, steps):
    """lr of group 0 at construction and after each of ``steps`` step() calls."""
    lrs = [schedule.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        lrs.append(schedule.optimizer.param_groups[0]["lr"])
    return lrs


def at(lrs, iteration):
    """The lr for ``last_batch_iteration == iteration``."""
    return lrs[iteration + 1]


# --- WarmupLR -------------------------------------------------------------------------------


def test_warmup_lr_log():
    opt = groups(1.0)
    lrs = run(WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10), 15)
    assert lrs[0] == 0.0
    assert at(lrs, 0) == pytest.approx(0.0)
    assert at(lrs, 4) == pytest.approx(0.1 * math.log(5) / math.log(10))
    assert at(lrs, 8) == pytest.approx(0.1 * math.log(9) / math.log(10))
    assert at(lrs, 9) == pytest.approx(0.1)  # log(10) / log(10)
    assert at(lrs, 10) == pytest.approx(0.1)
    assert at(lrs, 13) == pytest.approx(0.1)


def test_warmup_lr_linear_from_nonzero_min():
    opt = groups(1.0)
    lrs = run(
        WarmupLR(
            opt, warmup_min_lr=0.02, warmup_max_lr=0.12, warmup_num_steps=10, warmup_type="linear"
        ),
        12,
    )
    assert lrs[0] == pytest.approx(0.02)
    assert at(lrs, 0) == pytest.approx(0.02)
    assert at(lrs, 5) == pytest.approx(0.07)
    assert at(lrs, 9) == pytest.approx(0.11)
    assert at(lrs, 10) == pytest.approx(0.12)


def test_warmup_lr_max_defaults_to_each_group_lr():
    opt = groups(0.4, 0.2)
    schedule = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    assert schedule.get_last_lr() == [0.0, 0.0]
    schedule.step(2)
    assert schedule.get_last_lr() == pytest.approx([0.2, 0.1])
    schedule.step(7)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.4, 0.2])


def test_warmup_lr_per_group_lists_and_short_warmup():
    opt = groups(1.0, 1.0)
    schedule = WarmupLR(
        opt,
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=[1.0, 0.5],
        warmup_num_steps=1,
        warmup_type="linear",
    )
    # DeepSpeed warms up over at least 2 steps.
    assert schedule.warmup_num_steps == 2
    schedule.step()
    assert schedule.get_lr() == pytest.approx([0.0, 0.1])
    schedule.step()
    assert schedule.get_lr() == pytest.approx([0.5, 0.3])
    schedule.step()
    assert schedule.get_lr() == pytest.approx([1.0, 0.5])
    with pytest.raises(ValueError, match="warmup_max_lr"):
        WarmupLR(opt, warmup_max_lr=[1.0])


# --- WarmupDecayLR --------------------------------------------------------------------------


def test_warmup_decay_lr_linear():
    opt = groups(1.0)
    lrs = run(
        WarmupDecayLR(
            opt, total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"
        ),
        30,
    )
    assert at(lrs, 4) == pytest.approx(0.04)
    assert at(lrs, 10) == pytest.approx(0.1)  # end of warmup: (20 - 10) / (20 - 10)
    assert at(lrs, 15) == pytest.approx(0.05)  # mid decay
    assert at(lrs, 19) == pytest.approx(0.01)
    assert at(lrs, 20) == pytest.approx(0.0)
    assert at(lrs, 28) == pytest.approx(0.0)  # clamped past total_num_steps


def test_warmup_decay_lr_log_and_default_max():
    opt = groups(1.0)
    schedule = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=10)
    assert schedule.max_lrs == [0.001]  # DeepSpeed's default peak for this schedule
    schedule.step(3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * math.log(4) / math.log(10))
    schedule.step(55)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * 45 / 90)


# --- WarmupCosineLR -------------------------------------------------------------------------


def test_warmup_cosine_lr_linear():
    opt = groups(0.2)
    schedule = WarmupCosineLR(
        opt,
        total_num_steps=25,
        warmup_min_ratio=0.1,
        warmup_num_steps=5,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    lrs = run(schedule, 32)
    assert lrs[0] == 0.0  # DeepSpeed: ratio 0 before the first step
    assert at(lrs, 0) == pytest.approx(0.2 * 0.1)
    assert at(lrs, 2) == pytest.approx(0.2 * (0.1 + 0.9 * 2 / 5))
    assert at(lrs, 4) == pytest.approx(0.2 * (0.1 + 0.9 * 4 / 5))
    # First decay step: progress (5 - 5 + 1) / (25 - 5).
    assert at(lrs, 5) == pytest.approx(0.2 * (0.01 + 0.99 * (1 + math.cos(math.pi / 20)) / 2))
    assert at(lrs, 14) == pytest.approx(0.2 * (0.01 + 0.99 * 0.5))  # progress 1/2: mid decay
    assert at(lrs, 24) == pytest.approx(0.2 * 0.01)  # progress 1
    assert at(lrs, 30) == pytest.approx(0.2 * 0.01)  # held at the floor


def test_warmup_cosine_lr_log_ratios_follow_each_group_base_lr():
    opt = groups(0.2, 0.02)
    schedule = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    schedule.step(4)
    ratio = math.log(5) / math.log(10)
    assert schedule.get_last_lr() == pytest.approx([0.2 * ratio, 0.02 * ratio])
    schedule.step(9)
    assert schedule.get_last_lr() == pytest.approx([0.2, 0.02])


# --- OneCycle -------------------------------------------------------------------------------


def one_cycle(opt, **overrides):
    params = dict(
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_step_size=2,
        decay_lr_rate=0.5,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    return OneCycle(opt, **{**params, **overrides})


def test_one_cycle_lr():
    opt = groups(1.0)
    with pytest.warns(UserWarning, match="cycle_momentum"):  # (no optimizer defaults: no betas)
        schedule = one_cycle(opt)
    lrs = run(schedule, 15)
    # b = iteration + 1 over a cycle of 4 up + 6 down.
    assert at(lrs, -1) == pytest.approx(0.01)
    assert at(lrs, 1) == pytest.approx(0.055)  # b=2: half way up
    assert at(lrs, 3) == pytest.approx(0.1)  # b=4: peak
    assert at(lrs, 6) == pytest.approx(0.055)  # b=7: half way down
    assert at(lrs, 9) == pytest.approx(0.01)  # b=10: cycle end
    # Decay: d = iteration - 10 + 1 steps past the cycle, d / decay_step_size intervals.
    assert at(lrs, 10) == pytest.approx(0.01 / (1 + 0.5 * 0.5))
    assert at(lrs, 13) == pytest.approx(0.01 / (1 + 0.5 * 2))


ONECYCLE_FIXTURE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed" / "onecycle_0.19.8.json"
)
OPTIMIZERS = {
    "AdamW": lambda ps, d: torch.optim.AdamW(ps, **d),
    "Adam": lambda ps, d: torch.optim.Adam(ps, **d),
    "SGD": lambda ps, d: torch.optim.SGD(ps, **d),
}


@pytest.mark.parametrize("case", ["adamw_decay", "adam_no_decay", "adamw_stairs", "sgd_momentum"])
def test_one_cycle_equals_deepspeed_lr_and_betas(case):
    """lr, betas (beta1 cycled, beta2 set to 0.99, cycle_min_mom before the first step) and an SGD's
    momentum (not cycled) after each step, as DeepSpeed 0.19.8's OneCycle wrote them on the same
    optimizer (tests/fixtures/deepspeed/make_onecycle.py)."""
    recorded = json.loads(ONECYCLE_FIXTURE.read_text())[case]
    opt = OPTIMIZERS[recorded["optimizer"]](
        [torch.nn.Parameter(torch.zeros(2))], recorded["defaults"]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule = OneCycle(opt, **recorded["params"])
    assert any("cycle_momentum" in str(w.message) for w in caught) == (case == "sgd_momentum")
    for k, row in enumerate(recorded["rows"]):
        if k:
            schedule.step()
        group = opt.param_groups[0]
        assert group["lr"] == pytest.approx(row["lr"], rel=1e-12, abs=1e-15), (
            k,
            group["lr"],
            row["lr"],
        )
        if row["betas"] is not None:
            assert list(group["betas"]) == pytest.approx(row["betas"], rel=1e-12), (
                k,
                group["betas"],
                row,
            )
        assert group.get("momentum") == row["momentum"]


def test_one_cycle_momentum_off():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], betas=(0.5, 0.999))
    one_cycle(opt, cycle_momentum=False).step(3)
    assert opt.param_groups[0]["betas"] == (0.5, 0.999)


def test_one_cycle_staircase():
    opt = groups(1.0)
    schedule = one_cycle(opt, cycle_first_stair_count=2, cycle_momentum=False)
    lrs = run(schedule, 10)
    # Up half: b * 2 / 4 floored to stairs of 1/2; down half: (10 - b) * 2 / 6.
    assert at(lrs, 0) == pytest.approx(0.01)  # b=1: stair 0
    assert at(lrs, 1) == pytest.approx(0.055)  # b=2: stair 1
    assert at(lrs, 2) == pytest.approx(0.055)  # b=3: still stair 1
    assert at(lrs, 3) == pytest.approx(0.1)  # b=4: peak
    assert at(lrs, 4) == pytest.approx(0.055)  # b=5: floor(5 * 2 / 6) = 1
    assert at(lrs, 7) == pytest.approx(0.01)  # b=8: floor(2 * 2 / 6) = 0


# --- LRRangeTest ----------------------------------------------------------------------------


def test_lr_range_test_continuous_and_staircase():
    lrs = run(
        LRRangeTest(
            groups(1.0),
            lr_range_test_min_lr=0.01,
            lr_range_test_step_size=10,
            lr_range_test_step_rate=2.0,
        ),
        12,
    )
    assert lrs[0] == pytest.approx(0.01)
    assert at(lrs, 4) == pytest.approx(0.01 * (1 + 2.0 * 5 / 10))
    assert at(lrs, 9) == pytest.approx(0.03)
    stairs = run(
        LRRangeTest(
            groups(1.0),
            lr_range_test_min_lr=0.01,
            lr_range_test_step_size=10,
            lr_range_test_step_rate=2.0,
            lr_range_test_staircase=True,
        ),
        12,
    )
    assert at(stairs, 8) == pytest.approx(0.01)
    assert at(stairs, 9) == pytest.approx(0.03)


# --- mechanics shared by all ----------------------------------------------------------------

ALL = [
    ("WarmupLR", dict(warmup_max_lr=0.1, warmup_num_steps=7)),
    (
        "WarmupDecayLR",
        dict(total_num_steps=30, warmup_max_lr=0.1, warmup_num_steps=7, warmup_type="linear"),
    ),
    ("WarmupCosineLR", dict(total_num_steps=30, warmup_num_steps=7, warmup_min_ratio=0.05)),
    (
        "OneCycle",
        dict(
            cycle_min_lr=0.01,
            cycle_max_lr=0.1,
            cycle_first_step_size=5,
            decay_step_size=3,
            decay_lr_rate=0.1,
        ),
    ),
    ("LRRangeTest", dict(lr_range_test_min_lr=0.01, lr_range_test_step_size=4)),
]


@pytest.mark.parametrize("name,params", ALL, ids=[name for name, _ in ALL])
def test_state_dict_round_trip_continues_identically(name, params):
    first = build_scheduler(name, params, groups(0.5, betas=(0.9, 0.999)))
    for _ in range(9):
        first.step()
    # The resumed optimizer holds already-scheduled lrs; the state must not depend on them.
    resumed_opt = groups(0.5, betas=(0.9, 0.999))
    resumed = build_scheduler(name, params, resumed_opt)
    resumed_opt.param_groups[0]["lr"] = 123.0
    resumed.load_state_dict(first.state_dict())
    assert resumed_opt.param_groups == first.optimizer.param_groups
    for _ in range(25):
        first.step()
        resumed.step()
        assert resumed.get_last_lr() == first.get_last_lr()
        assert resumed_opt.param_groups == first.optimizer.param_groups


@pytest.mark.parametrize("name,params", ALL, ids=[name for name, _ in ALL])
def test_sets_lr_on_construction_and_step_and_explicit_iteration(name, params):
    opt = groups(0.5, momentum=0.9)
    schedule = build_scheduler(name, params, opt)
    assert opt.param_groups[0]["lr"] == schedule.get_lr()[0] == schedule.get_last_lr()[0]
    schedule.step()
    assert schedule.last_batch_iteration == 0
    assert opt.param_groups[0]["lr"] == schedule.get_last_lr()[0]
    schedule.step(11)
    assert schedule.last_batch_iteration == 11
    replay = build_scheduler(name, params, groups(0.5, momentum=0.9))
    for _ in range(12):
        replay.step()
    assert replay.get_last_lr() == schedule.get_last_lr()


def test_resume_by_last_batch_iteration_argument():
    fresh = WarmupLR(groups(1.0), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    fresh.step(4)
    resumed = WarmupLR(
        groups(1.0),
        warmup_max_lr=0.1,
        warmup_num_steps=10,
        warmup_type="linear",
        last_batch_iteration=4,
    )
    assert resumed.get_last_lr() == fresh.get_last_lr() == pytest.approx([0.04])


def test_works_on_a_torch_optimizer_with_tensor_lr():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=torch.tensor(0.5))
    lr_tensor = opt.param_groups[0]["lr"]
    schedule = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    schedule.step(5)
    assert opt.param_groups[0]["lr"] is lr_tensor  # updated in place
    assert lr_tensor.item() == pytest.approx(0.05)
    assert schedule.get_last_lr() == pytest.approx([0.05])


def test_rejects_an_object_without_param_groups():
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())


# --- build_scheduler ------------------------------------------------------------------------


def test_build_scheduler_is_case_insensitive():
    assert isinstance(
        build_scheduler("warmupcosinelr", {"total_num_steps": 2000}, groups(1.0)), WarmupCosineLR
    )
    one_cycle_params = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}
    assert isinstance(
        build_scheduler("ONECYCLE", one_cycle_params, groups(1.0, momentum=0.9)), OneCycle
    )
    assert isinstance(
        build_scheduler("WarmupDecayLR", {"total_num_steps": 2000}, groups(1.0)), WarmupDecayLR
    )


def test_warns_when_warmup_outlasts_the_schedule():
    with pytest.warns(UserWarning, match="total_num_steps 10 is less than warmup_num_steps 1000"):
        build_scheduler("WarmupCosineLR", {"total_num_steps": 10}, groups(1.0))


@pytest.mark.parametrize(
    "type_name,params,expected",
    [
        ("WarmupLRR", {}, r"scheduler.type 'WarmupLRR'.*did you mean 'WarmupLR'"),
        ("Cosine", {}, r"scheduler.type 'Cosine'"),
        (
            "WarmupLR",
            {"warmup_num_step": 10},
            r"scheduler.params.warmup_num_step .*did you mean 'warmup_num_steps'",
        ),
        ("WarmupDecayLR", {}, r"scheduler.params.total_num_steps is required"),
        ("OneCycle", {"cycle_min_lr": 0.1}, r"scheduler.params.cycle_max_lr is required"),
        (
            "WarmupLR",
            {"warmup_type": "cosine"},
            r"scheduler.params.warmup_type must be 'log' or 'linear'",
        ),
        ("WarmupLR", {"warmup_num_steps": -1}, r"scheduler.params.warmup_num_steps must be >= 0"),
        (
            "WarmupLR",
            {"warmup_num_steps": 10.5},
            r"scheduler.params.warmup_num_steps must be an integer",
        ),
        ("WarmupLR", {"warmup_max_lr": "auto"}, r"scheduler.params.warmup_max_lr must be a number"),
        (
            "LRRangeTest",
            {"lr_range_test_staircase": 1},
            r"scheduler.params.lr_range_test_staircase must be true or false",
        ),
    ],
)
def test_build_scheduler_errors_name_the_key(type_name, params, expected):
    with pytest.raises(ValueError, match=expected):
        build_scheduler(type_name, params, groups(1.0))


def test_integral_float_step_counts_are_accepted():
    schedule = build_scheduler("WarmupLR", {"warmup_num_steps": 100.0}, groups(1.0))
    assert schedule.warmup_num_steps == 100


SCHEDULES_FIXTURE = ONECYCLE_FIXTURE.with_name("schedules_0.19.8.json")


@pytest.mark.parametrize(
    "case", [k for k in json.loads(SCHEDULES_FIXTURE.read_text()) if k != "deepspeed"]
)
def test_every_schedule_equals_deepspeed(case):
    """Each schedule's lr before the first step and after each of 24, with every extra parameter
    (warmup_type, warmup_min_ratio, cos_min_ratio, the staircase), as DeepSpeed 0.19.8 wrote them
    (tests/fixtures/deepspeed/make_schedules.py)."""
    recorded = json.loads(SCHEDULES_FIXTURE.read_text())[case]
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=recorded["optimizer_lr"])
    schedule = build_scheduler(recorded["schedule"], recorded["params"], opt)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(len(recorded["lrs"]) - 1):
        schedule.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(recorded["lrs"], rel=1e-12, abs=1e-15)
