"""Parameters that get no gradient in a step (#24 item 1): a branch no rank takes at some steps.

torch's optimizers skip a parameter whose ``.grad`` is None: no step count, no weight decay, no
moment or momentum update, and a momentum buffer or moment is created only at the parameter's first
real step. zengine steps flat shards, so it keeps a step count per parameter and steps only the
pieces some rank gave a gradient, each with its own count. Checked against the single-process torch
reference with AdamW (bias correction reads the count), SGD with momentum, dampening and weight decay
(the buffer starts as the first gradient), Adam with L2 decay, at every stage, with the compiled
CPU-Adam (offload to CPU) and the NVMe-swapped Adam (stages 0-2 and ZeRO-Infinity), and across a
checkpoint saved while the counts differ, loaded at another world size.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zengine
from harness import spawn
from test_zero_parity import engine_config

VOCAB, DIM, HIDDEN, MICRO, LR = 29, 12, 18, 2, 1e-2
# The branches each step takes (the same on every rank): "right" is first used at step 1, "left" is
# skipped at steps 3 and 5, so the two branches' step counts differ from step 3 on.
SCHEDULE = ("l", "lr", "l", "r", "lr", "r")
OPTIMIZERS = {
    "AdamW": {
        "type": "AdamW",
        "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1},
    },
    "SGD": {
        "type": "SGD",
        "params": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    },
    "Adam": {
        "type": "Adam",
        "params": {
            "lr": LR,
            "betas": [0.8, 0.9],
            "eps": 1e-8,
            "weight_decay": 0.05,
            "adam_w_mode": False,
        },
    },  # L2: decay through the moments
}


class BranchNet(nn.Module):
    """Two residual branches the caller picks per step; a branch not taken gets no gradient."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(DIM, HIDDEN)
        self.left = nn.Linear(HIDDEN, HIDDEN)
        self.right = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, y, branches: str):
        h = torch.relu(self.fc(self.emb(x)))
        if "l" in branches:
            h = h + torch.tanh(self.left(h))
        if "r" in branches:
            h = h + torch.tanh(self.right(h))
        return F.cross_entropy(self.head(h).view(-1, VOCAB), y.view(-1))


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (rows, 4), generator=g)
    return x, (x * 5 + 1) % VOCAB


def torch_optimizer(name: str, params):
    spec = OPTIMIZERS[name]["params"]
    if name == "AdamW":
        return torch.optim.AdamW(
            params, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=spec["weight_decay"]
        )
    if name == "Adam":
        return torch.optim.Adam(
            params, lr=LR, betas=(0.8, 0.9), eps=1e-8, weight_decay=spec["weight_decay"]
        )
    return torch.optim.SGD(
        params, lr=spec["lr"], momentum=0.9, dampening=0.1, weight_decay=spec["weight_decay"]
    )


def reference(init: nn.Module, name: str, steps, rows: int) -> dict[str, torch.Tensor]:
    """Plain torch on the global batch: ``zero_grad(set_to_none=True)``, so an untaken branch has no grad."""
    model = copy.deepcopy(init)
    opt = torch_optimizer(name, model.parameters())
    for s in steps:
        opt.zero_grad(set_to_none=True)
        model(*batch(s, rows), SCHEDULE[s]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def config(stage: int, name: str, offload, world: int) -> dict:
    cfg = engine_config(stage, "fp32", 1, world, offload)
    cfg["optimizer"] = copy.deepcopy(OPTIMIZERS[name])
    cfg.pop("gradient_clipping")
    return cfg


def train(engine, steps, world: int) -> None:
    rank = dist.get_rank()
    for s in steps:
        x, y = batch(s, MICRO * world)
        engine.backward(
            engine(
                x[rank * MICRO : (rank + 1) * MICRO],
                y[rank * MICRO : (rank + 1) * MICRO],
                SCHEDULE[s],
            )
        )
        engine.step()


def whole(engine) -> dict[str, torch.Tensor]:
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def errors(cases) -> dict[str, float]:
    """Each case (stage, optimizer, offload): the largest parameter difference from torch after every step."""
    world = dist.get_world_size()
    out = {}
    for stage, name, offload in cases:
        torch.manual_seed(0)
        model = BranchNet()
        init = copy.deepcopy(model)
        engine, *_ = zengine.initialize(model=model, config=config(stage, name, offload, world))
        train(engine, range(len(SCHEDULE)), world)
        got, ref = whole(engine), reference(init, name, range(len(SCHEDULE)), MICRO * world)
        out[f"stage {stage} {name} {offload or 'device'}"] = max(
            (got[n] - ref[n]).abs().max().item() for n in ref
        )
        engine.destroy()
    return out


def _assert_match(results) -> None:
    bad = {case: err for case, err in results[0].items() if not err < 1e-5}
    assert not bad, (
        f"parameters differ from torch (a parameter without a gradient was stepped?): {bad}"
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_parameters_step_as_torch(stage):
    cases = [(stage, name, False) for name in OPTIMIZERS] + (
        [(stage, "AdamW", "cpu")] if stage else []
    )
    _assert_match(spawn(errors, 2, cases))


def test_unused_parameters_step_as_torch_swapped_adam():
    """The NVMe-swapped Adam (stage 2) and ZeRO-Infinity (stage 3) step only the used pieces of a chunk."""
    _assert_match(spawn(errors, 3, [(2, "AdamW", "nvme"), (3, "Adam", "infinity")]))


def save_diverged(stage: int, name: str, offload, path: str) -> None:
    """Train to step 4 (the branches' counts differ), save."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(model=BranchNet(), config=config(stage, name, offload, world))
    train(engine, range(4), world)
    engine.save_checkpoint(path)
    engine.destroy()


def resume_error(stage: int, name: str, offload, path: str) -> float:
    """Load at this world size, train the last two steps, compare with torch over all six."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    init = BranchNet()
    engine, *_ = zengine.initialize(
        model=copy.deepcopy(init), config=config(stage, name, offload, world)
    )
    engine.load_checkpoint(path)
    train(engine, range(4, len(SCHEDULE)), world)
    got = whole(engine)
    engine.destroy()
    # The global batch of each step is MICRO x the saving world's ranks before the save, this world's after;
    # the reference sees the same rows.
    ref = copy.deepcopy(init)
    opt = torch_optimizer(name, ref.parameters())
    for s in range(len(SCHEDULE)):
        opt.zero_grad(set_to_none=True)
        rows = MICRO * (2 if s < 4 else world)
        ref(*batch(s, rows), SCHEDULE[s]).backward()
        opt.step()
    return max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize(
    "stage,name,offload", [(2, "AdamW", False), (3, "SGD", False), (1, "AdamW", "cpu")]
)
def test_step_counts_survive_a_checkpoint_at_another_world_size(stage, name, offload):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        spawn(save_diverged, 2, stage, name, offload, path)
        err = spawn(resume_error, 3, stage, name, offload, path)[0]
    assert err < 1e-5, f"after a resume at W=3 the parameters differ from torch by {err}"
