"""Collective calls made on some ranks only fail by name on every rank (#24 item 6; distributed/agreement.py).

``if rank == 0: engine.save_checkpoint(...)`` (or a stage-3 ``summon_full_params`` / ``GatheredParameters``
for logging, or ``safe_get_full_fp32_param``) used to pair that call's collectives with whatever the other
ranks ran next: rank 0 read garbage, rank 1 aborted inside gloo. Now the ranks meet in the store before
such a call's first collective: the rank in the call and the ranks elsewhere all raise
``CollectiveCallError`` within seconds, naming the call. Calls that run no collective (stages 0-2's
``summon_full_params``) stay rank-local, and calls every rank makes work as before.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn
from zengine.distributed.agreement import CollectiveCallError


def _engine(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zengine.initialize(model=model, config=config)
    return engine


def _call(engine, what: str, path: str):
    if what == "summon_full_params":
        with engine.summon_full_params():
            return float(sum(p.detach().norm() for p in engine.module.parameters()))
    if what == "GatheredParameters":
        with zengine.zero.GatheredParameters(list(engine.module.parameters())):
            return float(sum(p.detach().norm() for p in engine.module.parameters()))
    if what == "save_checkpoint":
        return engine.save_checkpoint(path)
    if what == "safe_get_full_fp32_param":
        return float(zengine.utils.safe_get_full_fp32_param(engine.module[0].weight).norm())
    raise ValueError(what)


def _train(engine, steps: int, callers: dict, path: str):
    """``steps`` steps; before step 1, rank r makes the call ``callers.get(r)`` (if any)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    start = time.monotonic()
    try:
        for i in range(steps):
            if i == 1 and rank in callers:
                _call(engine, callers[rank], path)
            engine.backward(engine(torch.randn(2, 16, generator=gen)).pow(2).mean())
            engine.step()
    except CollectiveCallError as e:
        return "CollectiveCallError", str(e), time.monotonic() - start
    with engine.summon_full_params(writeback=False):
        return (
            "trained",
            [p.detach().tolist() for p in engine.module.parameters()],
            time.monotonic() - start,
        )


def one_rank_calls(stage: int, what: str, path: str):
    return _train(_engine(stage), 3, {0: what}, path)


def ranks_call_different(stage: int, path: str):
    return _train(_engine(stage), 3, {0: "summon_full_params", 1: "save_checkpoint"}, path)


def every_rank_calls(stage: int, what: str, path: str, world: int):
    return _train(_engine(stage), 3, {r: what for r in range(world)}, path)


@pytest.mark.parametrize(
    "stage, what, world",
    [
        (3, "summon_full_params", 2),
        (3, "GatheredParameters", 3),
        (2, "save_checkpoint", 2),
        (1, "safe_get_full_fp32_param", 2),
    ],
)
def test_a_call_on_rank_0_only_fails_by_name_on_every_rank(tmp_path, stage, what, world):
    results = spawn(one_rank_calls, world, stage, what, str(tmp_path / "ckpt"), timeout=120)
    for rank, (outcome, message, seconds) in enumerate(results):
        assert outcome == "CollectiveCallError", (rank, outcome)
        assert what in message and "every rank" in message, (rank, message)
        assert seconds < 60, f"rank {rank} took {seconds:.0f} s (comm_timeout is 300 s)"
    assert "rank 0 called " + what in results[0][1], results[0][1]
    for rank in range(
        1, world
    ):  # the ranks left in the training step's collectives say who is where
        assert f"rank {rank} was waiting in the collective" in results[rank][1], results[rank][1]
        assert f"rank 0 in {what}" in results[rank][1], results[rank][1]


def test_ranks_in_different_calls_fail_naming_each_call(tmp_path):
    results = spawn(ranks_call_different, 2, 3, str(tmp_path / "ckpt"), timeout=120)
    for rank, (outcome, message, _) in enumerate(results):
        assert outcome == "CollectiveCallError", (rank, outcome)
        assert "different collective calls" in message, message
        assert (
            "rank 0: summon_full_params" in message
            or "rank 0 (this rank): summon_full_params" in message
        )
        assert (
            "rank 1: save_checkpoint" in message or "rank 1 (this rank): save_checkpoint" in message
        )


# (summon_full_params and save_checkpoint made by every rank are exercised throughout the suite)
@pytest.mark.parametrize(
    "stage, what", [(3, "GatheredParameters"), (1, "safe_get_full_fp32_param")]
)
def test_calls_every_rank_makes_train_as_without_them(tmp_path, stage, what):
    with_call = spawn(every_rank_calls, 2, stage, what, str(tmp_path / "ckpt"), 2, timeout=120)
    without = spawn(every_rank_calls, 2, stage, "none", str(tmp_path / "unused"), 0, timeout=120)
    for (outcome, params, _), (_, reference, _) in zip(with_call, without):
        assert outcome == "trained"
        assert params == reference  # bit-identical


def test_a_rank_local_call_at_stage_2_stays_rank_local(tmp_path):
    """Stages 0-2 keep parameters whole: summon_full_params runs no collective, so rank 0 alone may call it."""
    alone = spawn(one_rank_calls, 2, 2, "summon_full_params", str(tmp_path / "x"), timeout=120)
    plain = spawn(every_rank_calls, 2, 2, "none", str(tmp_path / "y"), 0, timeout=120)
    for (outcome, params, _), (_, reference, _) in zip(alone, plain):
        assert outcome == "trained"
        assert params == reference  # bit-identical
