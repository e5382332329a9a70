"""Stage 3's always-on gather check (#24 item 3a): ranks that gather different parameters fail by name.

When ranks run different modules (a data-dependent branch, MoE routing without a leaf module), their
stage-3 all-gathers pair up different parameters. Where the sizes differ that is a hang on NCCL; where
they agree the forward silently computes with another module's weights. zengine chains a digest of every
gather and tags each rank's row of a staged gather; the boundary step's all-reduce carries both, so every
rank raises FetchOrderError before anything is updated, naming the gather where the ranks parted, without
a collective of its own on the normal path. A forward outside training checks the tags at its end.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import SHARD_ALL, ds_config
from harness import spawn
from zengine import FetchOrderError

DIM = 8


class Stack(nn.Module):
    """Linear layers of one shape; ``order`` says which run (set per rank to make the ranks diverge)."""

    def __init__(self, n: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM, bias=bias) for _ in range(n))
        self.order = list(range(n))

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x.square().mean()


def config(**extra) -> dict:
    return ds_config(3, micro_batch=4, gas=1, zero={**SHARD_ALL, **extra})


def diverging_run(bias: bool, mode: str):
    """Rank 1 runs layer 2 where rank 0 runs layer 1 (same shapes: the gathers' sizes agree). Fetching on
    demand and releasing at once, both ranks issue the same number of gathers: they pair up wrongly."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(
        model=Stack(3, bias),
        config=config(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0),
    )
    with engine.summon_full_params(writeback=False):
        before = [p.detach().clone() for p in engine.module.parameters()]
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # one agreeing step first: the check passes and resets
        engine.backward(engine(x))
        engine.step()
    with engine.summon_full_params(writeback=False):
        before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        if (
            mode == "train"
        ):  # every layer runs, in another order: the collectives pair up, the parameters do not
            engine.module.order = [0, 1, 2] if rank == 0 else [0, 2, 1]
            engine.backward(engine(x))
            engine.step()
        else:
            engine.module.order = [0, 1] if rank == 0 else [0, 2]
            engine.eval()
            with torch.no_grad():
                engine(x)
    except FetchOrderError as e:
        message = str(e)
    else:
        message = "no error"
    engine.module.order = [0, 1, 2]
    with engine.summon_full_params(writeback=False):  # the ranks can still work together afterwards
        unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    return message, unchanged


@pytest.mark.parametrize(
    "bias,mode",
    [(True, "train"), (False, "train"), (True, "eval")],
    ids=["staged-train", "direct-train", "staged-eval"],
)
def test_ranks_gathering_different_modules_raise_before_any_update(bias, mode):
    results = spawn(diverging_run, 2, bias, mode, timeout=120)
    for rank, (message, unchanged) in enumerate(results):
        assert "gathered different parameters" in message, (rank, message)
        assert "layers.1" in message and "layers.2" in message, message  # each rank's gather, named
        assert "set_z3_leaf_modules" in message, message  # the way out
        assert unchanged, rank  # nothing was updated


def agreeing_run():
    """The check costs no collective of its own: a normal run issues the same collectives with it."""
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(model=Stack(3, True), config=config())
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
    engine.eval()
    with torch.no_grad():
        engine(x)
    fetcher = engine.optimizer.fetcher
    return fetcher.check.issued_count, float(
        fetcher.check.bad
    ) if fetcher.check.bad is not None else None


def test_agreeing_ranks_pass_the_check():
    results = spawn(agreeing_run, 3)
    assert all(r == results[0] for r in results), results
    issued, bad = results[0]
    assert issued > 0 and bad == 0.0, results  # the eval forward's gathers counted, none mixed


def skipping_run():
    """The common case: rank 1 skips a layer (an expert no token was routed to), so the ranks issue different
    numbers of collectives. The collectives' identity check (distributed/identity.py) names it at the first
    collective where the ranks part, on every rank, with each rank's latest gather and the way out (before
    it, a wait bounded by comm_timeout and then a named timeout)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(model=Stack(3, True), config=dict(config(), comm_timeout=5))
    x = torch.randn(4, DIM)
    engine.backward(engine(x))
    engine.step()
    engine.module.order = [0, 1, 2] if rank == 0 else [0, 2]
    try:
        engine.backward(engine(x))
        engine.step()
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_ranks_skipping_a_module_fail_by_name_within_the_timeout():
    for rank, (kind, message) in enumerate(spawn(skipping_run, 2, timeout=120)):
        assert kind in ("CollectiveMismatchError", "FetchOrderError"), (rank, kind, message)
        assert "stage-3 gather" in message and "set_z3_leaf_modules" in message, (rank, message)
