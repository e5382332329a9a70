"""fp16 dynamic loss scaling: an overflow on one rank skips the step everywhere and halves the scale."""

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, make_batches, micro_batch


def overflow_run(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 0,
        },
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1},
    }
    engine, *_ = zengine.initialize(model=EdgeNet(), config=cfg)
    batches = make_batches(4, 2 * world)
    record = []
    for step, batch in enumerate(batches):
        x, y = micro_batch(batch, rank, world, 2, 0)
        with engine.summon_full_params(writeback=False):
            before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        loss = engine(x, y)
        if step == 1 and rank == world - 1:
            loss = loss * 1e6  # overflows fp16 gradients on this rank only
        engine.backward(loss)
        scale = engine.loss_scale
        engine.step()
        with engine.summon_full_params(writeback=False):
            changed = any(
                not torch.equal(before[n], p) for n, p in engine.module.named_parameters()
            )
        record.append((engine.was_step_applied(), scale, engine.loss_scale, changed))
    return record


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overflow_skips_everywhere_and_halves_scale(stage):
    for record in spawn(overflow_run, 2, stage):
        applied, before, after, changed = zip(*record)
        assert applied == (True, False, True, True)
        assert changed == (True, False, True, True)
        assert before[1] == 1024.0 and after[1] == 512.0  # halved on overflow
        assert after[0] == 1024.0 and after[2] == 512.0  # unchanged otherwise (window not reached)


def test_dynamic_scaler_rules():
    from zengine.precision.loss_scaler import DynamicLossScaler

    s = DynamicLossScaler(2.0**4, window=3, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 16  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 8
    for _ in range(3):
        s.update(False)
    assert s.scale == 16  # doubled after a clean window
    for _ in range(10):
        s.update(True)
    assert s.scale == 2.0  # never below min_loss_scale
