"""Data-dependent execution at stage 3 (#24 item 3b): a top-1 mixture-of-experts layer whose experts run
by routing, so ranks run different experts in one step. Marked as a leaf module (``set_z3_leaf_modules``,
or the config's ``zero_optimization.leaf_module``), it gathers all its experts on entry and trains to
the single-process torch reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zengine
from configs import SHARD_ALL, adamw, ds_config
from harness import spawn
from models import train_beside_reference

DIM, HIDDEN, EXPERTS, STEPS, MICRO, LR = 10, 16, 4, 3, 4, 1e-2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, h):
        return self.fc2(torch.relu(self.fc1(h)))


class TopOneMoE(nn.Module):
    """Each token goes to the expert its gate scores highest; only experts that receive tokens run."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.ran: list[list[int]] = []  # the experts each forward ran (for the test)

    def forward(self, h):
        weights = torch.softmax(self.gate(h), dim=-1)  # [tokens, experts]
        choice = weights.argmax(-1)
        out = torch.zeros_like(h)
        ran = sorted(set(choice.tolist()))
        self.ran.append(ran)
        for e in ran:
            mask = choice == e
            out[mask] = self.experts[e](h[mask]) * weights[mask, e].unsqueeze(-1)
        return out


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = TopOneMoE()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        return F.mse_loss(self.head(h + self.moe(h)).squeeze(-1), y)


def _config(leaf_in_config: bool):
    leaf = {"leaf_module": {"classes": ["TopOneMoE"]}} if leaf_in_config else {}
    return ds_config(
        3,
        micro_batch=MICRO,
        gas=1,
        optimizer=adamw(LR, weight_decay=0.01),
        zero={
            **SHARD_ALL,
            "stage3_prefetch_bucket_size": 200,
            "stage3_max_reuse_distance": 0,
            "reduce_bucket_size": 300,
            **leaf,
        },
    )


def moe_training(leaf_in_config: bool) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MoENet()
    reference = copy.deepcopy(model)
    if not leaf_in_config:
        marked = zengine.utils.set_z3_leaf_modules(model, [TopOneMoE])
        assert marked == [model.moe] and zengine.utils.get_z3_leaf_modules(model) == [model.moe]
    engine, *_ = zengine.initialize(model=model, config=_config(leaf_in_config))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(MICRO * world, DIM, generator=g) * 2, torch.randn(MICRO * world, generator=g))
        for _ in range(STEPS)
    ]
    errors = train_beside_reference(engine, reference, ref_opt, batches, MICRO)
    return {"errors": errors, "ran": model.moe.ran}


@pytest.mark.parametrize("leaf_in_config", [False, True], ids=["set_z3_leaf_modules", "config"])
def test_experts_chosen_per_rank_train_as_in_torch(leaf_in_config):
    results = spawn(moe_training, 2, leaf_in_config)
    assert any(a != b for a, b in zip(results[0]["ran"], results[1]["ran"])), (
        "the ranks ran the same experts"
    )
    for r in results:
        assert max(r["errors"].values()) < 1e-5, r["errors"]


def test_leaf_marks_by_class_and_name():
    model = MoENet()
    assert zengine.utils.set_z3_leaf_modules(model, ["TopOneMoE"]) == [model.moe]
    assert zengine.utils.z3_leaf_module(model.moe) and not zengine.utils.z3_leaf_module(model.inp)
    assert zengine.utils.unset_z3_leaf_modules(model, [TopOneMoE]) == [model.moe]
    assert zengine.utils.get_z3_leaf_modules(model) == []
    with pytest.raises(ValueError, match="no module of the classes"):
        zengine.utils.set_z3_leaf_modules(model, [nn.GRU])
