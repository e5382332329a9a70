"""A run resumed with other accumulation steps (same global batch, another world size and micro batch)
takes its global batches whole: the boundaries follow the global steps, not the saved micro-step count
modulo the new accumulation steps (issue 41 case 4). Checked against plain torch on the global batches."""

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, reference_run, train_global_batch

GLOBAL, MICRO, STEPS, STOP = 12, 2, 4, 1
LR, CLIP = 1e-2, 0.5


def _engine(stage: int, seed: int):
    world = dist.get_world_size()
    cfg = {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 30},
        "steps_per_print": 1000,
    }
    torch.manual_seed(seed)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    assert engine.gradient_accumulation_steps() == GLOBAL // (MICRO * world)
    return engine


def _train(engine, batches) -> list[float]:
    gas = engine.gradient_accumulation_steps()
    return [train_global_batch(engine, b, MICRO, gas) for b in batches]


def save_after(path: str) -> list:
    engine = _engine(1, seed=0)  # W=2: 3 micro-steps a step
    losses = _train(engine, make_batches(STEPS, GLOBAL)[:STOP])
    engine.save_checkpoint(path)
    return losses


def resume(path: str, stages) -> list:
    out = []
    for stage in stages:
        engine = _engine(stage, seed=1)  # W=3: 2 micro-steps a step; 3 saved micro-steps
        engine.load_checkpoint(path)
        losses = _train(engine, make_batches(STEPS, GLOBAL)[STOP:])
        with engine.summon_full_params(writeback=False):
            params = {n: p.detach().clone().tolist() for n, p in engine.module.named_parameters()}
        out.append({"losses": losses, "params": params, "steps": engine.global_steps})
    return out


def test_resume_with_other_accumulation_steps(tmp_path):
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    ref_losses, ref_params = reference_run(EdgeNet(), make_batches(STEPS, GLOBAL), LR, CLIP)
    for saved in spawn(save_after, 2, path):
        assert saved == pytest.approx(ref_losses[:STOP], rel=1e-5)
    for rank, runs in enumerate(spawn(resume, 3, path, (1, 3))):  # every rank
        for stage, got in zip((1, 3), runs):
            assert got["steps"] == STEPS, stage
            assert got["losses"] == pytest.approx(ref_losses[STOP:], rel=1e-5), (rank, stage)
            worst = max(
                (torch.tensor(got["params"][n]) - p).abs().max().item()
                for n, p in ref_params.items()
            )
            assert worst <= 1e-5, (
                f"W=2 gas 3 -> W=3 gas 2, stage {stage}, rank {rank}: max parameter error "
                f"{worst:.3g}"
            )
