"""A script's own ``torch.nn.utils.clip_grad_norm_(engine.module.parameters(), max_norm)`` between
``engine.backward`` and ``engine.step()`` (issue 41 case 1): at stages 0-1 the ``.grad`` it reads is
what torch would hold there (the mean gradient of the global batch), so the norm it returns and the
run equal plain torch clipped at ``max_norm``; before, ``.grad`` held the sum over ranks (W x the norm)
and the run equalled torch clipped at max_norm / W. At stages 2-3, where each rank holds only a shard
of the gradient outside ``.grad``, the call stops by name on every rank before any update (it returned
0 and clipped nothing)."""

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, micro_batch, reference_run

GLOBAL, STEPS, LR, MAX_NORM = 8, 3, 1e-2, 0.5


def _engine(stage: int, gas: int):
    world = dist.get_world_size()
    cfg = {
        "train_batch_size": GLOBAL,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 30},
        "steps_per_print": 1000,
    }
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    assert engine.train_micro_batch_size_per_gpu() * world * gas == GLOBAL
    return engine


def clipped_run(stage: int, gas: int) -> dict:
    """The user's loop: gas micro-steps of forward / engine.backward / (at the boundary) the script's
    own clip_grad_norm_ / engine.step."""
    engine = _engine(stage, gas)
    rank, world, micro = (
        dist.get_rank(),
        dist.get_world_size(),
        engine.train_micro_batch_size_per_gpu(),
    )
    norms = []
    for batch in make_batches(STEPS, GLOBAL):
        for m in range(gas):
            engine.backward(engine(*micro_batch(batch, rank, world, micro, m)))
            if engine.is_gradient_accumulation_boundary():
                norms.append(
                    float(torch.nn.utils.clip_grad_norm_(engine.module.parameters(), MAX_NORM))
                )
            engine.step()
    with engine.summon_full_params(writeback=False):
        params = {n: p.detach().clone().tolist() for n, p in engine.module.named_parameters()}
    return {"norms": norms, "params": params}


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    norms = []
    _, params = reference_run(EdgeNet(), make_batches(STEPS, GLOBAL), LR, MAX_NORM, norms=norms)
    return norms, params


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("gas", [1, 2])
def test_own_clipping_follows_torch(reference, stage, gas):
    ref_norms, ref_params = reference
    for rank, got in enumerate(spawn(clipped_run, 2, stage, gas)):
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), (
            f"stage {stage} gas {gas} rank {rank}"
        )
        worst = max(
            (torch.tensor(got["params"][n]) - p).abs().max().item() for n, p in ref_params.items()
        )
        assert worst <= 1e-5, (
            f"stage {stage} gas {gas} rank {rank}: max parameter error {worst:.3g}"
        )


def refused_run(stage: int) -> dict:
    engine = _engine(stage, 1)
    rank, world, micro = (
        dist.get_rank(),
        dist.get_world_size(),
        engine.train_micro_batch_size_per_gpu(),
    )
    with engine.summon_full_params(writeback=False):
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    batch = make_batches(1, GLOBAL)[0]
    engine.backward(engine(*micro_batch(batch, rank, world, micro, 0)))
    with pytest.raises(zengine.ShardedGradientError, match="gradient_clipping") as caught:
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), MAX_NORM)
    with engine.summon_full_params(writeback=False):
        same = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    return {"message": str(caught.value), "same": same, "steps": engine.global_steps}


@pytest.mark.parametrize("stage", [2, 3])
def test_own_clipping_refused_where_grads_are_sharded(stage):
    for got in spawn(refused_run, 2, stage):
        assert "clip_grad_norm_" in got["message"] and got["same"] and got["steps"] == 0
