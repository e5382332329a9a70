"""Writes to parameters that zengine used to discard silently (#24 item 4): each now works as in torch,
or is named once with the way out.

(a) ``self.apply(init_fn)`` at the end of a root module's constructor inside ``zero.Init`` initialises the
    already-partitioned children as a model built whole would be; a write after ``Init`` (lost: the
    parameter is an empty tensor) is named at ``initialize``;
(b) ``engine.module.load_state_dict(sd)`` after ``initialize`` in bf16/fp16 is what the next step starts
    from (the fp32 masters used to win and restore the old values);
(c) a parameter switched to ``requires_grad=True`` after ``initialize`` is named at the step;
(d) ``engine.module.state_dict()`` at stage 3 outside a gather holds the whole parameters (gathered; it held
    empty tensors after a warning, issue 41 case 7).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from zengine.engine.build import UnfrozenParameterError
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, train_global_batch
from test_zero_parity import MICRO, engine_config


class SelfInitNet(nn.Module):
    """A model that initialises itself the usual way: ``self.apply(self._init)`` at the end of ``__init__``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 40)
        self.fc2 = nn.Linear(40, 12)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Records(logging.Handler):
    """The zengine logger's warnings, kept for the test."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("zengine").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


def _stage3(precision="fp32"):
    return engine_config(3, precision, 1, dist.get_world_size())


def init_under_zero_init() -> dict:
    torch.manual_seed(0)
    reference = SelfInitNet()  # built whole, the same draws from the generator
    torch.manual_seed(0)
    with zengine.zero.Init():
        model = SelfInitNet()
    engine, *_ = zengine.initialize(model=model, config=_stage3())
    with engine.summon_full_params(writeback=False):
        return {
            n: torch.equal(p.detach(), dict(reference.named_parameters())[n])
            for n, p in model.named_parameters()
        }


def test_apply_at_the_end_of_the_constructor_initialises_partitioned_children():
    for equal in spawn(init_under_zero_init, 2):
        assert all(equal.values()), (
            equal
        )  # std 0.02 and zero biases, as built whole (rank 0's draws)


def write_after_init() -> list[str]:
    records = Records()
    with zengine.zero.Init():
        model = SelfInitNet()
    nn.init.zeros_(
        model.fc1.weight
    )  # after Init: the parameter is an empty tensor, the write goes nowhere
    zengine.initialize(model=model, config=_stage3())
    return records.messages


def test_a_write_to_a_partitioned_parameter_is_named():
    for messages in spawn(write_after_init, 2):  # on every rank
        lost = [m for m in messages if "written in place while partitioned" in m]
        assert len(lost) == 1 and "fc1.weight" in lost[0] and "GatheredParameters" in lost[0], (
            messages
        )
        assert "fc2.weight" not in lost[0]


def load_state_dict_between_steps(stage: int, precision: str) -> dict:
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=engine_config(stage, precision, 1, dist.get_world_size()),
        model_parameters=edge_param_groups(model, 1e-2),
    )
    batches = make_batches(2, MICRO * dist.get_world_size())
    train_global_batch(engine, batches[0], MICRO, 1)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    # far from where training is (every key, so that the tied head and embedding agree)
    engine.module.load_state_dict(
        {k: (v.float() + 1.0).to(v.dtype) for k, v in model.state_dict().items()}
    )
    expect = {
        n: p.detach().float().clone() for n, p in model.named_parameters()
    }  # as stored in the dtype
    train_global_batch(engine, batches[1], MICRO, 1)
    after = {n: p.detach().float() for n, p in model.named_parameters()}
    trained = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and n != "unused.weight" and n != "unused.bias"
    ]
    return {
        "from_loaded": max((after[n] - expect[n]).abs().max().item() for n in trained),
        "from_old": min((after[n] - before[n]).abs().max().item() for n in trained),
    }


@pytest.mark.parametrize("stage,precision", [(0, "bf16"), (1, "fp16"), (2, "bf16")])
def test_load_state_dict_after_initialize_is_trained_from(stage, precision):
    for r in spawn(load_state_dict_between_steps, 2, stage, precision):
        # one AdamW step of lr 1e-2 (2e-2 for vectors) moves each element by about lr at most
        assert r["from_loaded"] < 0.05, r
        assert r["from_old"] > 0.5, r  # not back at the values before the load


def unfreeze_after_initialize(stage: int) -> dict:
    """Progressive unfreezing (issue 41 case 3): a layer frozen at initialize is unfrozen after a step.
    Nothing may be updated after the unfreeze: the next step() raises by name, on every rank."""
    records = Records()
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=engine_config(stage, "fp32", 1, dist.get_world_size()),
        model_parameters=edge_param_groups(model, 1e-2),
    )
    batches = make_batches(2, MICRO * dist.get_world_size())
    train_global_batch(engine, batches[0], MICRO, 1)
    before = {n: p.detach().clone() for n, p in full_parameters(engine).items()}
    model.frozen.weight.requires_grad_(True)
    try:
        train_global_batch(engine, batches[1], MICRO, 1)
        error = None
    except UnfrozenParameterError as e:
        error = str(e)
    after = full_parameters(engine)
    return {
        "error": error,
        "moved": [n for n in before if not torch.equal(before[n], after[n])],
        "warned": [m for m in records.messages if "left out of model_parameters" in m],
    }


def full_parameters(engine) -> dict:
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_unfrozen_after_initialize_stops_the_run_by_name(stage):
    for r in spawn(unfreeze_after_initialize, 2, stage):
        assert (
            r["error"] is not None
            and "frozen.weight" in r["error"]
            and "frozen.bias" not in r["error"]
        ), r
        assert "Unfreeze before initialize" in r["error"]
        assert r["moved"] == [], r  # raised before the step updated anything
        assert r["warned"] == [], r


def left_out_of_model_parameters() -> list[str]:
    """A parameter that requires grad but was left out of model_parameters on purpose: warned once."""
    records = Records()
    torch.manual_seed(0)
    model = EdgeNet()
    groups = edge_param_groups(model, 1e-2)
    groups[1]["params"] = [p for p in groups[1]["params"] if p is not model.fc2.bias]
    engine, *_ = zengine.initialize(
        model=model,
        config=engine_config(2, "fp32", 1, dist.get_world_size()),
        model_parameters=groups,
    )
    for batch in make_batches(2, MICRO * dist.get_world_size()):
        train_global_batch(engine, batch, MICRO, 1)
    return [m for m in records.messages if "left out of model_parameters" in m]


def test_a_parameter_left_out_of_model_parameters_is_named_once():
    for warned in spawn(left_out_of_model_parameters, 2):
        assert len(warned) == 1 and "fc2.bias" in warned[0], warned


def state_dict_at_stage3() -> dict:
    records = Records()
    torch.manual_seed(0)
    model = SelfInitNet()
    engine, *_ = zengine.initialize(model=model, config=_stage3())
    with engine.summon_full_params(writeback=False):
        whole = copy.deepcopy(engine.module.state_dict())  # gathered already
    outside = engine.module.state_dict()  # gathered by the call
    same = all(torch.equal(whole[k], v) for k, v in outside.items())
    return {
        "messages": records.messages,
        "whole": {k: tuple(v.shape) for k, v in whole.items()},
        "outside": {k: tuple(v.shape) for k, v in outside.items()},
        "same": same,
    }


def test_state_dict_of_partitioned_parameters_is_whole():
    for r in spawn(state_dict_at_stage3, 2):
        assert r["whole"]["fc1.weight"] == (40, 24) and r["outside"] == r["whole"] and r["same"]
        assert not any("state_dict" in m for m in r["messages"])
