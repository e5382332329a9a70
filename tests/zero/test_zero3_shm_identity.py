"""Stage 3: ranks whose modules differ in shape (a branch that runs on some ranks only) fail by name
on every rank, through the shared-memory segment and through plain gloo alike (issue 41 case 8):
every collective carries the same identity check (distributed/identity.py: kind, dtype, sizes),
which the shared-memory sync is and which precedes every collective through the backend. Before,
the ranks' syncs paired up across different collectives, and through gloo the payloads of other
sizes aborted the process inside gloo (SIGABRT, ``op.preamble.length <= op.nbytes``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn
from zengine import FetchOrderError

DIM = 8


class Branches(nn.Module):
    """Rank 0 runs ``narrow``, the others ``wide`` (another shape): their gathers' sizes differ."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.narrow = nn.Linear(DIM, DIM)
        self.wide = nn.Linear(DIM, 3 * DIM)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        x = self.narrow(x) if dist.get_rank() == 0 else self.wide(x)[:, :DIM]
        return x.square().mean()


def diverging_run(shared: bool) -> tuple[str, bool]:
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "shared_memory": {"enabled": True, "piece_size": 256} if shared else {"enabled": False},
    }
    engine, *_ = zengine.initialize(model=Branches(), config=cfg)
    with engine.summon_full_params(writeback=False):
        before = [p.detach().clone() for p in engine.module.parameters()]
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        engine.backward(engine(x))
        engine.step()
    except FetchOrderError as e:
        message = str(e)
    else:
        message = "no error"
    with engine.summon_full_params(writeback=False):  # the ranks can still work together afterwards
        unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    return message, unchanged


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "gloo"])
def test_ranks_with_modules_of_other_shapes_fail_by_name(shared, world):
    for rank, (message, unchanged) in enumerate(spawn(diverging_run, world, shared, timeout=120)):
        assert message != "no error", rank
        # this rank's gather, and every rank's collective beside it
        assert ("narrow" if rank == 0 else "wide") in message, (rank, message)
        assert "narrow.weight" in message and "wide.weight" in message, (rank, message)
        assert "set_z3_leaf_modules" in message, message  # the way out
        assert unchanged, rank
