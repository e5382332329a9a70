"""no_sync(): gradients accumulate locally with no communication; the boundary reduces them all."""

import copy

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, micro_batch, reference_run
from zengine.distributed import collectives as comm

LR = 1e-2


def run(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    init = copy.deepcopy(model)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 300,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    calls = []
    for name in ("all_reduce_sum", "reduce_sum_to", "broadcast"):
        original = getattr(comm, name)
        setattr(
            comm, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1]
        )
    batches = make_batches(4, 2 * 2 * world)
    for batch in batches:
        with engine.no_sync():
            x, y = micro_batch(batch, rank, world, 2, 0)
            engine.backward(engine(x, y))
        # no gradient communication; stage 3 still gathers parameters (broadcasts on gloo) to compute
        grad_calls = [c for c in calls if c != "broadcast" or stage < 3]
        assert grad_calls == [], f"communication inside no_sync: {grad_calls}"
        engine.step()
        x, y = micro_batch(batch, rank, world, 2, 1)
        engine.backward(engine(x, y))
        engine.step()
        calls.clear()
    with pytest.raises(RuntimeError, match="inside engine.no_sync"):
        with engine.no_sync():
            engine.step()
    _, ref = reference_run(init, batches, LR, clip=0.0)
    with engine.summon_full_params(writeback=False):
        worst = max(
            (p.detach() - ref[n]).abs().max().item() for n, p in engine.module.named_parameters()
        )
    assert worst < 1e-5, worst


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_accumulates_locally(stage):
    spawn(run, 3, stage)


def boundary_under_no_sync(stage, gas):
    """Every backward of the global batch, the boundary one included, under no_sync; step() outside.
    The step must reduce what no backward did (not step each rank on its local gradient, nor skip it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    init = copy.deepcopy(model)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 300,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    batches = make_batches(3, 2 * gas * world)
    for i, batch in enumerate(batches):
        for m in range(gas):
            x, y = micro_batch(batch, rank, world, 2, m)
            if i == 1 and m == 0:  # one micro-step synchronised, the boundary one not
                engine.backward(engine(x, y))
            else:
                with engine.no_sync():
                    engine.backward(engine(x, y))
            engine.step()
        assert engine.was_step_applied()
    assert engine.global_steps == len(batches)
    _, ref = reference_run(init, batches, LR, clip=0.0)
    with engine.summon_full_params(writeback=False):
        worst = max(
            (p.detach() - ref[n]).abs().max().item() for n, p in engine.module.named_parameters()
        )
    assert worst < 1e-5, f"stage {stage} gas {gas}: {worst}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_after_a_boundary_backward_under_no_sync_reduces(stage):
    spawn(boundary_under_no_sync, 2, stage, 2)
    if stage in (0, 2):
        spawn(boundary_under_no_sync, 3, stage, 1)
