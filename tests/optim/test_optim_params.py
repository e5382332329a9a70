"""The parameter rules that build_optimizer, build_scheduler and load_config share."""

import inspect
import types

import pytest
import torch

from zengine.optim import (
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
    build_optimizer,
    build_scheduler,
    optimizer_param_problems,
    scheduler_param_problems,
)
from zengine.optim import schedulers
from zengine.optim.params import CHOICE, FLAG, INTEGER, NUMBER, NUMBERS, Rule, param_problems


def groups(*lrs):
    return types.SimpleNamespace(param_groups=[{"lr": lr} for lr in lrs])


# --- Rule -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule,value,problem",
    [
        (Rule(NUMBER, minimum=0), -1, "must be >= 0, got -1"),
        (Rule(NUMBER, minimum=0, above_minimum=True), 0.0, "must be > 0, got 0.0"),
        (Rule(NUMBER), True, "must be a number, got True"),
        (Rule(NUMBER), "1e-3", "must be a number, got '1e-3'"),
        (Rule(NUMBER), float("inf"), "must be a finite number, got inf"),
        (Rule(INTEGER, minimum=1), 0, "must be >= 1, got 0"),
        (Rule(INTEGER), 2.5, "must be an integer, got 2.5"),
        (Rule(INTEGER), False, "must be an integer, got False"),
        (Rule(FLAG), 0, "must be true or false, got 0"),
        (Rule(FLAG), None, "must be true or false, got None"),
        (Rule(CHOICE, choices=("log", "linear")), "cos", "must be 'log' or 'linear', got 'cos'"),
        (
            Rule(NUMBERS, length=2, minimum=0, below=1),
            [0.9, 1.0],
            "must lie in [0, 1), got [0.9, 1.0]",
        ),
        (Rule(NUMBERS, length=2), (0.9, None), "must be a list of 2 numbers, got (0.9, None)"),
        (
            Rule(NUMBER, per_group=True),
            [],
            "must be a number or a list with one number per param group, got []",
        ),
        (Rule(NUMBER, minimum=0, per_group=True), [0.1, -0.1], "must be >= 0, got -0.1"),
    ],
)
def test_rule_problems(rule, value, problem):
    assert rule.problem(value) == problem


@pytest.mark.parametrize(
    "rule,value,parsed",
    [
        (Rule(NUMBER, minimum=0), 0, 0),
        (Rule(INTEGER), 100.0, 100),
        (Rule(NUMBERS, length=2, minimum=0, below=1), [0.9, 0], (0.9, 0.0)),
        (Rule(NUMBERS, length=2, null_entries=(0,)), [None, 1e-3], (None, 1e-3)),
        (Rule(NUMBER, per_group=True), [1, 2.5], [1, 2.5]),
        (Rule(FLAG, nullable=True), None, None),
    ],
)
def test_rule_parses(rule, value, parsed):
    assert rule.problem(value) is None
    result = rule.parse(value)
    assert result == parsed and type(result) is type(parsed)


def test_param_problems_lists_all_and_the_missing():
    rules = {"lr": Rule(NUMBER, minimum=0), "steps": Rule(INTEGER, required=True)}
    assert param_problems({"lr": -1, "stpes": 3}, rules, "Thing") == [
        ("lr", "must be >= 0, got -1"),
        ("stpes", "is not a parameter of Thing; did you mean 'steps'? (accepted: lr, steps)"),
        ("steps", "is required by Thing"),
    ]


# --- the builders report every problem at once ---------------------------------------------


def test_build_optimizer_names_every_problem():
    with pytest.raises(ValueError) as info:
        build_optimizer(
            "AdamW",
            {"lr": "auto", "weight_decay": -0.1, "betas": [0.9, 1.5], "eps": 0, "lrr": 1},
            [torch.nn.Parameter(torch.zeros(2))],
        )
    lines = str(info.value).splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == [
        "optimizer.params.lr",
        "optimizer.params.weight_decay",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.lrr",
    ]


def test_build_scheduler_names_every_problem():
    with pytest.raises(ValueError) as info:
        build_scheduler("WarmupDecayLR", {"warmup_num_steps": -1, "warmup_typ": "log"}, groups(0.1))
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert lines[0] == "scheduler.params.warmup_num_steps must be >= 0, got -1 (WarmupDecayLR)"
    assert lines[1].startswith(
        "scheduler.params.warmup_typ is not a parameter of WarmupDecayLR; did you mean"
    )
    assert (
        lines[2] == "scheduler.params.total_num_steps is required by WarmupDecayLR (WarmupDecayLR)"
    )


def test_a_per_group_list_must_match_the_groups_at_build():
    assert scheduler_param_problems("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}) == []
    with pytest.raises(
        ValueError, match="warmup_max_lr has 3 entries but the optimizer has 2 param groups"
    ):
        build_scheduler("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}, groups(0.1, 0.1))


def test_eps_zero_is_refused_by_the_builder():
    with pytest.raises(ValueError, match=r"optimizer\.params\.eps must be > 0, got 0"):
        build_optimizer("Adam", {"eps": 0}, [torch.nn.Parameter(torch.zeros(2))])


def test_schedule_constructors_check_with_the_same_rules():
    with pytest.raises(ValueError, match="total_num_steps must be >= 1, got 0"):
        schedulers.WarmupDecayLR(groups(0.1), total_num_steps=0)
    with pytest.raises(ValueError, match="cycle_max_lr must be >= 0, got -1"):
        schedulers.OneCycle(groups(0.1), cycle_min_lr=0.0, cycle_max_lr=-1)


# --- one declaration: the rules follow the constructors ------------------------------------


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_schedule_parameter_has_a_rule(name):
    cls = getattr(schedulers, name)
    signature = inspect.signature(cls.__init__)
    accepted = [key for key in signature.parameters if key not in ("self", "optimizer")]
    assert set(accepted) <= set(schedulers.PARAM_RULES)
    required = [
        key for key in accepted if signature.parameters[key].default is inspect.Parameter.empty
    ]
    assert [key for key, _ in scheduler_param_problems(name, {})] == required
    unknown = scheduler_param_problems(name, {"nope": 1})[0][1]
    assert unknown.endswith(f"(accepted: {', '.join(sorted(accepted))})")


@pytest.mark.parametrize(
    "name", ["Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "CPUAdam", "DeepSpeedCPUAdam"]
)
def test_every_optimizer_keyword_is_accepted(name):
    cls = (
        torch.optim.Adam if "adam" in name.lower() else getattr(torch.optim, name)
    )  # the Adam family: Adam's
    signature = inspect.signature(cls.__init__)
    unknown = optimizer_param_problems(name, {"nope": 1})[0][1]
    accepted = unknown.split("(accepted: ")[1].rstrip(")").split(", ")
    for key in signature.parameters:
        if key not in ("self", "params", "decoupled_weight_decay"):
            assert key in accepted, key


def test_unknown_types_raise():
    with pytest.raises(ValueError, match="optimizer.type 'Adamm'"):
        optimizer_param_problems("Adamm", {})
    with pytest.raises(ValueError, match="scheduler.type 'Cosine'"):
        scheduler_param_problems("Cosine", {})
    assert "Adam" in OPTIMIZER_NAMES
