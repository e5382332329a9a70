"""The gradient reductions launch in one order on every rank, whatever order the gradients become ready in.

Collectives are matched by the order each rank issues them (NCCL's and gloo's rule), so a rank whose
buckets become ready in another order than its peers' must still launch them in the same sequence. The
readiness order differs when a parameter gets a gradient on some ranks only (a branch taken per rank, a
module detached on one rank): its bucket is ready at the end of backward there, during backward elsewhere.
Within one param group buckets launch in order; across param groups the sequence must be fixed too.

Checked against the single-process torch reference: rank 1 detaches a branch that rank 0 trains, with two
param groups (weights, and biases with their own learning rate) and one bucket per parameter. Before the
sequence spanned the groups, stages 0-3 failed here with mismatched collectives (a hang on NCCL).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zengine
from harness import spawn

DIM, MICRO, STEPS, LR = 10, 3, 4, 1e-2


class RankBranchNet(nn.Module):
    """fc -> + branch -> head; with ``detach`` the branch's output is a constant (its parameters get no gradient).
    The branch's weight and bias are in different param groups."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x, detach: bool):
        h = torch.tanh(self.fc(x))
        branch = torch.tanh(self.branch(h))
        h = h + (branch.detach() if detach else branch)
        return self.head(h).pow(2).mean()


def _groups(model, lr: float) -> list[dict]:
    return [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 2 * lr},
    ]


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2 * MICRO, DIM, generator=g) for _ in range(STEPS)]


def _train_stages(stages) -> dict:
    return {stage: _train(stage) for stage in stages}


def _train(stage: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = RankBranchNet()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        # stage 3: every parameter stays whole once gathered (persistent): the backward re-gathers nothing, which
        # would differ between the ranks (stage 3 needs the same modules' backward on every rank)
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 1,
            "stage3_param_persistence_threshold": 1000,
        },
    }
    engine, *_ = zengine.initialize(model=model, config=cfg, model_parameters=_groups(model, LR))
    for x in _batches():
        loss = engine(
            x[rank * MICRO : (rank + 1) * MICRO], detach=rank == 1
        )  # no branch gradient on rank 1
        engine.backward(loss)
        engine.step()
    return {
        n: zengine.utils.safe_get_full_fp32_param(p).tolist()
        for n, p in engine.module.named_parameters()
    }


def _reference() -> dict:
    torch.manual_seed(0)
    model = RankBranchNet()
    opt = torch.optim.AdamW(_groups(model, LR), lr=LR, weight_decay=0.01)
    for x in _batches():
        opt.zero_grad()
        loss = (
            model(x[:MICRO], detach=False) + model(x[MICRO:], detach=True)
        ) / 2  # the mean over the ranks
        loss.backward()
        opt.step()
    return {n: p.detach().tolist() for n, p in model.named_parameters()}


def test_buckets_launch_in_one_order_when_a_branch_is_detached_on_one_rank():
    ref = _reference()
    for rank, by_stage in enumerate(spawn(_train_stages, 2, (0, 2, 3))):
        for stage, params in by_stage.items():
            for name, value in ref.items():
                got = torch.tensor(params[name])
                assert torch.allclose(got, torch.tensor(value), atol=1e-6, rtol=1e-5), (
                    stage,
                    rank,
                    name,
                )
