"""Optimizer and scheduler ``params`` are checked by ``load_config``, before any process group or
engine exists, with the rules the builders apply, and every problem comes in the one ConfigError."""

import warnings

import pytest
import torch

import zengine
import zengine.api
from zengine.config import SUPPORTED_OPTIMIZERS, SUPPORTED_SCHEDULERS, ConfigError, load_config
from zengine.optim import OPTIMIZER_NAMES, SCHEDULER_NAMES, build_optimizer, build_scheduler

BASE = {"train_micro_batch_size_per_gpu": 2}

# The example: four problems in two sections, each found only at build time before.
FOUR_PROBLEMS = {
    **BASE,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "weight_decay": -0.1, "betas": [0.9, 1.5]},
    },
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
}


def _error(config) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config, 1)
    return str(info.value)


def _problem_lines(message: str) -> list:
    return [line.strip() for line in message.splitlines()[1:]]


def test_all_param_problems_in_one_error():
    lines = _problem_lines(_error(FOUR_PROBLEMS))
    assert len(lines) == 4
    for path in (
        "optimizer.params.lr:",
        "optimizer.params.weight_decay:",
        "optimizer.params.betas:",
        "scheduler.params.warmup_num_step:",
    ):
        assert sum(line.startswith(path) for line in lines) == 1, path
    assert "did you mean 'warmup_num_steps'?" in lines[-1]


def test_param_problems_come_with_the_other_problems():
    message = _error({**FOUR_PROBLEMS, "zero_optimization": {"stage": 4}, "fp16": {"enabled": 1}})
    assert "(6 problems)" in message.splitlines()[0]


def test_refused_by_initialize_before_the_process_group_and_the_engine(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("reached after the config was accepted")

    monkeypatch.setattr(zengine.api, "init_distributed", must_not_run)
    monkeypatch.setattr(zengine.api, "Engine", must_not_run)
    with pytest.raises(ConfigError) as info:
        zengine.initialize(model=torch.nn.Linear(2, 2), config=FOUR_PROBLEMS)
    assert "optimizer.params.lr:" in str(info.value) and "scheduler.params.warmup_num_step:" in str(
        info.value
    )
    assert not torch.distributed.is_initialized()


def test_auto_says_who_fills_it_in():
    message = _error(
        {
            **BASE,
            "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        }
    )
    for path in ("optimizer.params.lr", "scheduler.params.warmup_max_lr"):
        line = next(line for line in _problem_lines(message) if line.startswith(path))
        assert "must be a number, got 'auto'" in line
        assert "Hugging Face Trainer integration or by the autotuner" in line


BAD_OPTIMIZER_PARAMS = [
    ("Adam", {"eps": 0}, "eps", "must be > 0, got 0"),
    ("Adam", {"lr": float("nan")}, "lr", "must be a finite number"),
    ("Adam", {"lr": "1e-3"}, "lr", "must be a number, got '1e-3'"),
    ("AdamW", {"amsgrad": 1}, "amsgrad", "must be true or false, got 1"),
    ("AdamW", {"betas": [0.9]}, "betas", "must be a list of 2 numbers"),
    ("AdamW", {"betas": [-0.1, 0.99]}, "betas", "must lie in [0, 1)"),
    (
        "AdamW",
        {"max_grad_norm": 1.0},
        "max_grad_norm",
        "is not an optimizer parameter; use the top-level 'gradient_clipping' key",
    ),
    (
        "Adam",
        {"adam_w_mode": True, "adamw_mode": False},
        "adam_w_mode",
        "disagrees with adamw_mode",
    ),
    ("SGD", {"momentum": -0.9}, "momentum", "must be >= 0, got -0.9"),
    ("SGD", {"nesterov": "true"}, "nesterov", "must be true or false"),
    ("SGD", {"betas": [0.9, 0.99]}, "betas", "is not a parameter of the SGD optimizer"),
    ("Adagrad", {"lr_decay": -1}, "lr_decay", "must be >= 0"),
    ("RMSprop", {"alpha": -0.5}, "alpha", "must be >= 0"),
    (
        "RMSprop",
        {"centred": True},
        "centred",
        "is not a parameter of the RMSprop optimizer; did you mean 'centered'?",
    ),
    ("CPUAdam", {"adamw_mode": "yes"}, "adamw_mode", "must be true or false"),
    ("DeepSpeedCPUAdam", {"fp32_optimizer_states": False}, "fp32_optimizer_states", "must be true"),
]


@pytest.mark.parametrize("type_name,params,key,text", BAD_OPTIMIZER_PARAMS)
def test_optimizer_params_refused_at_load_and_at_build(type_name, params, key, text):
    message = _error({**BASE, "optimizer": {"type": type_name, "params": params}})
    assert f"\n  optimizer.params.{key}: {text}" in message
    with pytest.raises(ValueError) as info:  # the builder, given the same params, agrees
        build_optimizer(type_name, params, [torch.nn.Parameter(torch.zeros(2))])
    assert f"optimizer.params.{key} {text}" in str(info.value)


def test_unknown_param_names_the_optimizer_and_lists_the_accepted_ones():
    message = _error({**BASE, "optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentun": 0.9}}})
    line = next(
        line for line in _problem_lines(message) if line.startswith("optimizer.params.momentun:")
    )
    assert "is not a parameter of the SGD optimizer; did you mean 'momentum'?" in line
    assert (
        "(accepted: dampening, differentiable, foreach, fused, lr, maximize, momentum, nesterov,"
        in line
    )


BAD_SCHEDULER_PARAMS = [
    ("WarmupLR", {"warmup_num_steps": -1}, "warmup_num_steps", "must be >= 0, got -1"),
    ("WarmupLR", {"warmup_num_steps": 10.5}, "warmup_num_steps", "must be an integer, got 10.5"),
    (
        "WarmupLR",
        {"warmup_type": "cosine"},
        "warmup_type",
        "must be 'log' or 'linear', got 'cosine'",
    ),
    ("WarmupLR", {"warmup_max_lr": -0.1}, "warmup_max_lr", "must be >= 0, got -0.1"),
    ("WarmupLR", {"warmup_min_lr": [0.0, "x"]}, "warmup_min_lr", "must be a number, got 'x'"),
    ("WarmupDecayLR", {}, "total_num_steps", "is required by WarmupDecayLR"),
    ("WarmupDecayLR", {"total_num_steps": 0}, "total_num_steps", "must be >= 1, got 0"),
    (
        "WarmupCosineLR",
        {"total_num_steps": 100, "cos_min_ratio": -1},
        "cos_min_ratio",
        "must be >= 0",
    ),
    ("OneCycle", {"cycle_min_lr": 0.1}, "cycle_max_lr", "is required by OneCycle"),
    (
        "OneCycle",
        {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_momentum": 1},
        "cycle_momentum",
        "must be true or false",
    ),
    (
        "LRRangeTest",
        {"lr_range_test_step_size": 0},
        "lr_range_test_step_size",
        "must be >= 1, got 0",
    ),
    (
        "LRRangeTest",
        {"lr_range_test_staircase": "no"},
        "lr_range_test_staircase",
        "must be true or false",
    ),
]


@pytest.mark.parametrize("type_name,params,key,text", BAD_SCHEDULER_PARAMS)
def test_scheduler_params_refused_at_load_and_at_build(type_name, params, key, text):
    message = _error({**BASE, "scheduler": {"type": type_name, "params": params}})
    assert f"\n  scheduler.params.{key}: {text}" in message
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError) as info:
        build_scheduler(type_name, params, optimizer)
    assert f"scheduler.params.{key} {text}" in str(info.value)


GOOD = {
    "Adam": {
        "lr": 1e-3,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0,
        "adam_w_mode": False,
        "bias_correction": True,
        "torch_adam": False,
        "fused": None,
    },
    "AdamW": {
        "lr": 0,
        "betas": [0.0, 0.95],
        "eps": 1e-6,
        "weight_decay": 0.1,
        "amsgrad": True,
        "foreach": False,
    },
    "SGD": {"lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 1e-4, "nesterov": True},
    "Adagrad": {"lr": 0.01, "lr_decay": 0, "initial_accumulator_value": 0.1, "eps": 1e-10},
    "RMSprop": {"lr": 0.01, "alpha": 0.99, "eps": 1e-8, "momentum": 0, "centered": True},
    "CPUAdam": {"lr": 1e-3, "adamw_mode": True, "fp32_optimizer_states": True},
    "DeepSpeedCPUAdam": {
        "lr": 1e-3,
        "betas": [0.9, 0.999],
        "weight_decay": 0.01,
        "adamw_mode": True,
    },
    "WarmupLR": {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 1000,
        "warmup_type": "linear",
    },
    "WarmupDecayLR": {
        "total_num_steps": 10000,
        "warmup_min_lr": [0, 0.0],
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 100.0,
    },
    "WarmupCosineLR": {"total_num_steps": 10000, "warmup_min_ratio": 0, "cos_min_ratio": 0.1},
    "OneCycle": {
        "cycle_min_lr": 1e-4,
        "cycle_max_lr": 1e-3,
        "cycle_second_step_size": None,
        "decay_lr_rate": 0.1,
        "cycle_momentum": False,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 1e-5,
        "lr_range_test_step_size": 100,
        "lr_range_test_staircase": True,
    },
}


@pytest.mark.parametrize("name", SUPPORTED_OPTIMIZERS + SUPPORTED_SCHEDULERS)
def test_every_supported_type_loads_with_typical_params(name):
    section = "optimizer" if name in SUPPORTED_OPTIMIZERS else "scheduler"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config({**BASE, section: {"type": name, "params": GOOD[name]}}, 1)
    assert getattr(cfg, section).params == GOOD[name]  # kept as written, for the report


def test_config_types_are_types_the_builders_know():
    assert {name.lower() for name in SUPPORTED_OPTIMIZERS} <= {
        name.lower() for name in OPTIMIZER_NAMES
    }
    assert SUPPORTED_SCHEDULERS == SCHEDULER_NAMES


def test_an_unknown_type_is_one_problem_among_the_others():
    message = _error(
        {
            **BASE,
            "optimizer": {"type": "Adamm", "params": {"lr": -1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}},
            "steps_per_print": 0,
        }
    )
    lines = _problem_lines(message)
    assert any(line.startswith("optimizer.type: 'Adamm' is not an optimizer") for line in lines)
    assert any(line.startswith("scheduler.params.warmup_num_steps: must be >= 0") for line in lines)
    assert any(line.startswith("steps_per_print:") for line in lines)
