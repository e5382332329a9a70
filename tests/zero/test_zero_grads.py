"""Gradient buckets launch in the order the first backward completed them, agreed by every rank."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn


class Reversed(nn.Module):
    """Layers registered 0..n-1 and run n-1..0: gradients arrive in registration order."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _engine(stage):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 300,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, *_ = zengine.initialize(model=Reversed(), config=config)
    return engine


def _train(engine, steps=4):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(4 * world, 16, generator=g)
        engine.backward(engine(x[4 * rank : 4 * (rank + 1)]))
        engine.step()
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def reordered(stage, disagree):
    engine = _engine(stage)
    queues = engine.optimizer.grads.queues
    default = [list(q.order) for q in queues]
    rank = dist.get_rank()
    x = torch.randn(4, 16)
    engine.backward(engine(x))
    if disagree and rank == 1:  # this rank proposes another order than its peers
        proposal = engine.optimizer.grads.agreement.proposal
        proposal[0] = list(reversed(proposal[0]))
    engine.step()
    orders = [list(q.order) for q in queues]
    _train(engine, steps=2)  # and training goes on (the ranks launch in the same order either way)
    return default, orders


@pytest.mark.parametrize("stage", [2, 3])
def test_buckets_follow_the_first_backward(stage):
    for default, orders in spawn(reordered, 2, stage, False):
        assert orders != default, "the recorded order was not adopted"
        assert sorted(orders[0]) == sorted(default[0])  # a permutation of the same buckets


@pytest.mark.parametrize("stage", [2, 3])
def test_ranks_that_disagree_keep_the_index_order(stage):
    for default, orders in spawn(reordered, 2, stage, True):
        assert orders == default


def trained_alike(stage):
    reference = _train(_engine(0))
    got = _train(_engine(stage))
    return max((got[n] - reference[n]).abs().max().item() for n in got)


@pytest.mark.parametrize("stage", [2, 3])
def test_reordered_buckets_train_like_stage_0(stage):
    for worst in spawn(trained_alike, 2, stage):
        assert worst < 1e-6, worst
