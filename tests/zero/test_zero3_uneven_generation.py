"""Stage 3: ranks that generate different numbers of tokens (each stops at its own end-of-sequence,
as RLHF loops do) fail by name on every rank, through shared memory and plain gloo, at 2 and 3
ranks (issue 41 case 9): ``RanksOutOfStepError`` saying the ranks ran different numbers of forwards
and the way out. Before, gloo aborted the process (SIGABRT, a collective mismatch) or the rank that
went on to ``summon_full_params`` raised a ``CollectiveCallError`` naming that call. The way out
the message gives (the generation inside ``summon_full_params``) generates what the plain module
generates and trains on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn
from zengine import RanksOutOfStepError

VOCAB, DIM, PROMPT = 16, 8, [[1, 2]]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _greedy(model, steps: int) -> list[int]:
    """``steps`` tokens of greedy generation (each rank's own end-of-sequence: its own count)."""
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0].tolist()


def _engine(shared: bool):
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "shared_memory": {"enabled": True, "piece_size": 256} if shared else {"enabled": False},
    }
    engine, *_ = zengine.initialize(model=TinyLM(), config=cfg)
    return engine


def _train_step(engine) -> None:
    x = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).square().mean())
    engine.step()


def uneven_run(shared: bool, then: str) -> str:
    engine = _engine(shared)
    try:
        _greedy(engine, 2 + 3 * dist.get_rank())
        if then == "train":
            _train_step(engine)
        else:
            with engine.summon_full_params():
                pass
    except RanksOutOfStepError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "shared, world, then",
    [(True, 2, "train"), (False, 2, "summon"), (True, 3, "summon"), (False, 3, "train")],
    ids=["shm-2-train", "gloo-2-summon", "shm-3-summon", "gloo-3-train"],
)
def test_ranks_generating_different_lengths_fail_by_name(shared, world, then):
    for rank, message in enumerate(spawn(uneven_run, world, shared, then, timeout=120)):
        assert "different numbers of forwards" in message, (rank, message)
        assert "rank 1: " in message and "without gradients" in message, (rank, message)
        # the way out
        assert "summon_full_params" in message and "synced_gpus=True" in message, message


def way_out_run(shared: bool) -> tuple[list[int], list[int], float]:
    engine = _engine(shared)
    steps = 2 + 3 * dist.get_rank()
    with engine.summon_full_params(writeback=False):
        tokens = _greedy(engine, steps)
    torch.manual_seed(0)
    plain = TinyLM()  # the plain module, same initial weights
    reference = _greedy(plain, steps)
    _train_step(engine)  # the ranks still work together afterwards
    with engine.summon_full_params(writeback=False):
        pairs = zip(engine.module.parameters(), plain.parameters())
        moved = float(sum((p - q).abs().sum() for p, q in pairs))
    return tokens, reference, moved


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "gloo"])
def test_generation_inside_summon_full_params_is_the_plain_modules(shared):
    for rank, (tokens, reference, moved) in enumerate(spawn(way_out_run, 2, shared, timeout=120)):
        assert len(tokens) == len(PROMPT[0]) + 2 + 3 * rank
        assert tokens == reference, (rank, tokens, reference)
        assert moved > 0, rank  # the training step after it updated the parameters
