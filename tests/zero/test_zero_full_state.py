"""``zengine.utils.safe_get_full_*`` / ``safe_set_full_*``: one parameter whole at every stage, W=2 and 3."""

import copy

import pytest
import torch
import torch.distributed as dist

import zengine
from configs import SHARD_ALL, SMALL_BUCKETS, adamw, ds_config
from harness import spawn
from models import EdgeNet, make_batches, micro_batch
from zengine.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

MICRO, LR = 2, 1e-2


def _config(stage, precision):
    return ds_config(
        stage,
        precision,
        micro_batch=MICRO,
        optimizer=adamw(LR, weight_decay=0.0),
        zero={**SMALL_BUCKETS, **SHARD_ALL},
    )


def _full_state_run(stage, precision):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    ref = copy.deepcopy(model)
    engine, *_ = zengine.initialize(model=model, config=_config(stage, precision))
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0
    )
    out = {}
    batch = make_batches(2, MICRO * world)
    for step, b in enumerate(batch):
        loss = engine(*micro_batch(b, rank, world, MICRO, 0))
        engine.backward(loss)
        ref_opt.zero_grad()
        ref(*b).backward()
        if step == 1:  # between backward and step: the averaged gradient of the global batch
            out["grad"] = max(
                (safe_get_full_grad(p) - q.grad).abs().max().item()
                for (n, p), q in zip(engine.module.named_parameters(), ref.parameters())
                if p.requires_grad and q.grad is not None
            )
        engine.step()
        ref_opt.step()
    named = [
        (n, p, q)
        for (n, p), q in zip(engine.module.named_parameters(), ref.parameters())
        if p.requires_grad
    ]
    out["param"] = max((safe_get_full_fp32_param(p) - q).abs().max().item() for _, p, q in named)
    out["exp_avg"] = max(
        (safe_get_full_optimizer_state(p, "exp_avg") - ref_opt.state[q]["exp_avg"])
        .abs()
        .max()
        .item()
        for _, p, q in named
        if "exp_avg" in ref_opt.state[q]
    )
    out["frozen"] = safe_get_full_fp32_param(engine.module.frozen.weight)
    # set: the same value on every rank, read back whole; the module shows it
    target = engine.module.fc1.weight
    value = (
        torch.arange(target.numel() if stage < 3 else 41 * 23, dtype=torch.float32).view(41, 23)
        / 1000
    )
    safe_set_full_fp32_param(target, value)
    out["set_back"] = (safe_get_full_fp32_param(target) - value).abs().max().item()
    with engine.summon_full_params(writeback=False):
        out["set_module"] = (engine.module.fc1.weight.float() - value).abs().max().item()
    safe_set_full_optimizer_state(target, value * 2, "exp_avg")
    out["set_state"] = (
        (safe_get_full_optimizer_state(target, "exp_avg") - value * 2).abs().max().item()
    )
    out["missing_state"] = safe_get_full_optimizer_state(target, "no_such_state")
    if stage == 3:
        from zengine.zero import ZeroParamStatus

        p = engine.module.fc1.weight
        out["ds"] = (
            tuple(p.ds_shape),
            p.ds_numel,
            p.ds_status is ZeroParamStatus.NOT_AVAILABLE,
            p.ds_tensor.numel(),
            hasattr(p, "ds_id"),
            hasattr(copy.deepcopy(p), "ds_id"),
        )
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_parameter_gradient_and_state_at_every_stage(stage):
    for world in (2, 3):
        for out in spawn(_full_state_run, world, stage, "fp32"):
            assert out["grad"] < 2e-5 and out["param"] < 1e-5 and out["exp_avg"] < 1e-6, (
                world,
                out,
            )
            assert out["frozen"] is None  # no engine trains it
            assert out["set_back"] == 0 and out["set_module"] == 0 and out["set_state"] == 0, out
            assert out["missing_state"] is None
            if stage == 3:
                chunk = -(-41 * 23 // world)
                assert out["ds"] == ((41, 23), 41 * 23, True, chunk, True, False), out


def test_bf16_masters_stay_fp32():
    for out in spawn(_full_state_run, 2, 2, "bf16"):
        assert out["param"] < 5e-2 and out["set_back"] == 0, out  # fp32 masters, set exactly
        assert out["set_module"] < 1e-2  # the bf16 copy rounds
