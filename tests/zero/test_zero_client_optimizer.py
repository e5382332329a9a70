"""Any torch optimizer passed in (instance or callable) has its state sharded and matches torch."""

import copy

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, micro_batch, reference_run

LR = 0.05


def sgd(groups):
    return torch.optim.SGD(groups, lr=LR, momentum=0.9, nesterov=True)


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def run(stage, as_instance):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    init = copy.deepcopy(model)
    groups = edge_param_groups(model, LR)
    optimizer = sgd(groups) if as_instance else sgd
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 400,
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, opt, _, sched = zengine.initialize(
        model=model, config=cfg, model_parameters=groups, optimizer=optimizer, lr_scheduler=step_lr
    )
    if as_instance:
        assert opt.optimizer is optimizer  # the caller's object is kept, pointed at the shards
    batches = make_batches(5, 2 * world)
    for batch in batches:
        engine.backward(engine(*micro_batch(batch, rank, world, 2, 0)))
        engine.step()
    _, ref = reference_run(init, batches, LR, clip=0.0, make_optimizer=sgd, make_scheduler=step_lr)
    with engine.summon_full_params(writeback=False):
        worst = max(
            (p.detach() - ref[n]).abs().max().item() for n, p in engine.module.named_parameters()
        )
    assert worst < 1e-5, worst
    assert engine.get_lr() == pytest.approx([LR * 0.25, LR * 2 * 0.25])
    # momentum buffers are sharded with the master: each rank holds only its shard's worth
    numel = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    if stage == 3:
        assert numel == sum(g.shard_numel for g in opt.groups)
    else:
        total = sum(g.layout.padded_numel for g in opt.groups)
        assert numel == (total if stage == 0 else total // world)


@pytest.mark.parametrize("stage,as_instance", [(0, True), (1, False), (2, True), (3, False)])
def test_client_optimizer_and_scheduler(stage, as_instance):
    spawn(run, 3, stage, as_instance)
