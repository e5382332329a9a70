"""OneCycle from the config trains as DeepSpeed's schedule would (issue 41 case 6): AdamW at stage 2 on 2
ranks against one process stepping torch's AdamW with the lr and betas DeepSpeed 0.19.8's OneCycle wrote
before each step (tests/fixtures/deepspeed/onecycle_0.19.8.json, case adamw_decay)."""

import json

import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn
from test_optim_schedulers import ONECYCLE_FIXTURE

STEPS, MICRO = 6, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(world):
    g = torch.Generator().manual_seed(2)
    return torch.randn(STEPS, MICRO * world, 4, generator=g), torch.randn(
        STEPS, MICRO * world, 1, generator=g
    )


def _train():
    rank, world = dist.get_rank(), dist.get_world_size()
    case = json.loads(ONECYCLE_FIXTURE.read_text())["adamw_decay"]
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1.0, "betas": case["defaults"]["betas"], "weight_decay": 0.0},
        },
        "scheduler": {"type": "OneCycle", "params": case["params"]},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zengine.initialize(model=_model(), config=cfg)
    xs, ys = _data(world)
    betas = []
    for x, y in zip(xs, ys):
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        betas.append(tuple(engine.get_mom()[0]))
        engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().tolist() for n, p in engine.module.named_parameters()}, betas


def test_one_cycle_from_the_config_trains_as_deepspeeds_schedule():
    case = json.loads(ONECYCLE_FIXTURE.read_text())["adamw_decay"]
    model = _model()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1.0, betas=tuple(case["defaults"]["betas"]), weight_decay=0.0
    )
    xs, ys = _data(2)
    for step, (x, y) in enumerate(zip(xs, ys)):
        row = case["rows"][step]  # what the schedule set before this step
        opt.param_groups[0]["lr"], opt.param_groups[0]["betas"] = row["lr"], tuple(row["betas"])
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for params, betas in spawn(_train, 2):
        assert [list(b) for b in betas] == [r["betas"] for r in case["rows"][:STEPS]]
        worst = max(
            (torch.tensor(params[n]) - p.detach()).abs().max().item()
            for n, p in model.named_parameters()
        )
        assert worst < 1e-6, worst
