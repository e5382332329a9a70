"""The collectives' identity check (distributed/identity.py): its arithmetic without a process group,
its cost counted in a stage-3 step (one extra all-reduce per collective through gloo, none through
shared memory), and a mismatch outside stage 3 named on every rank before the payload moves."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn
from zengine import CollectiveMismatchError
from zengine.distributed import collectives, identity, traffic


def test_the_max_of_identity_and_its_negation_agrees_only_when_every_rank_brought_it():
    a = identity.identity("all_gather", torch.float32, [2, 40])
    b = identity.identity("all_gather", torch.float32, [2, 76])
    assert a == identity.identity("all_gather", torch.float32, (2, 40)) and a != b
    assert "all_gather of float32 [2, 40]" == identity.describe(a)
    # the MAX over ranks of [id, -id]: [max id, -min id]
    assert identity.agreed(torch.tensor([a, -a]))
    assert not identity.agreed(torch.tensor([max(a, b), -min(a, b)]))
    # on a device: counted there (max - min), not read
    device = torch.device("cpu")
    before = identity.pending(device)
    start = 0 if before is None else int(before)
    identity.count_on_device(torch.tensor([a, -a]))
    identity.count_on_device(torch.tensor([max(a, b), -min(a, b)]))
    assert int(identity.pending(device)) - start == abs(a - b)


def _step_costs(shared: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "shared_memory": {"enabled": True, "piece_size": 4096} if shared else {"enabled": False},
    }
    engine, *_ = zengine.initialize(model=model, config=cfg)
    x = torch.randn(2, 64)
    for step in range(3):  # the third is measured (the trace recorded, prefetch running)
        if step == 2:
            checks = identity.checks()
            traffic.snapshot(reset=True)
        engine.backward(engine(x).square().mean())
        engine.step()
    calls = sum(v["calls"] for per in traffic.snapshot().values() for v in per.values())
    return identity.checks() - checks, calls


@pytest.mark.parametrize("shared", [False, True], ids=["gloo", "shared-memory"])
def test_every_collective_is_checked_once(shared):
    """gloo: one check (an extra 16-byte all-reduce) per collective; shared memory: each piece's
    sync is the check (no extra collective), and only collectives under 64 KiB go through gloo."""
    checks, calls = spawn(_step_costs, 2, shared, timeout=120)[0]
    assert calls > 0
    if shared:
        assert checks >= calls  # a sync per piece (several per collective), no extra all-reduce
    else:
        assert checks == calls, (checks, calls)


def _mismatch(world: int) -> str:
    rank = dist.get_rank()
    try:
        collectives.all_reduce_sum(torch.ones(3 + rank))  # other sizes on every rank
    except CollectiveMismatchError as e:
        message = str(e)
    else:
        message = "no error"
    t = torch.ones(4)
    collectives.all_reduce_sum(t)  # the ranks still work together: nothing was sent
    assert t.tolist() == [float(world)] * 4
    return message


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_of_other_sizes_fail_by_name_on_every_rank(world):
    for rank, message in enumerate(spawn(_mismatch, world, world, timeout=60)):
        assert "made different collectives" in message, (rank, message)
        for r in range(world):
            assert f"all_reduce of float32 [{3 + r}]" in message, (rank, message)
