"""DeepSpeed's universal checkpoints both ways. In: ``checkpoint.load_universal: true`` loads what DeepSpeed
0.19.8's ``ds_to_universal`` wrote (tests/fixtures/deepspeed/universal/, make_universal.py) at other world
sizes and stages, with the state DeepSpeed had at the save, and continues as DeepSpeed continued from it
(the source fixture's reference.pt). Out: ``zengine-convert to-universal`` writes the same layout, read
back equal; DeepSpeed itself loads it with load_universal when it is installed."""

from __future__ import annotations

import io
import os

import pytest
import torch

import zengine
from deepspeed_runs import CONTINUED, SAVED_AT, TiedLM, batches, config, make_optimizer, train
from harness import spawn
from test_deepspeed_migration import FIXTURES, TOLERANCE, _full_state, _worst, reference

UNIVERSAL = os.path.join(FIXTURES, "universal")
# world size -> [(fixture, stage)]: each universal fixture (saved at W=2) into W=1 and W=3, stages 1-3
CASES = {1: [("s2_fp32_w2", 3), ("s3_bf16_w2", 1)], 3: [("s2_fp32_w2", 1), ("s3_bf16_w2", 2)]}


def universal_config(stage: int, precision: str, world: int) -> dict:
    return {**config(stage, precision, world), "checkpoint": {"load_universal": True}}


def load_universal(targets: list) -> bytes:
    """Rank body: each (fixture, stage) into a fresh engine through load_universal, then CONTINUED steps."""
    world = torch.distributed.get_world_size()
    out = []
    for fixture, stage, precision in targets:
        torch.manual_seed(1)
        model = TiedLM()
        engine, *_ = zengine.initialize(
            model=model,
            optimizer=make_optimizer(model),
            config=universal_config(stage, precision, world),
        )
        loaded, client_state = engine.load_checkpoint(os.path.join(UNIVERSAL, fixture))
        at_load = _full_state(engine)
        with torch.no_grad(), engine.summon_full_params(writeback=False):
            frozen = {
                n: p.detach().cpu().clone()
                for n, p in engine.module.named_parameters()
                if not p.requires_grad
            }
        counters = engine.global_steps
        losses = train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:])
        out.append(
            {
                "loaded": loaded,
                "client_state": client_state,
                "at_load": at_load,
                "frozen": frozen,
                "steps": counters,
                "losses": losses,
                "after": _full_state(engine)["master"],
            }
        )
        engine.destroy()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.parametrize("world", [1, 3])
def test_universal_checkpoint_continues_as_deepspeed(world):
    targets = [(f, s, reference(f)["precision"]) for f, s in CASES[world]]
    results = torch.load(io.BytesIO(spawn(load_universal, world, targets)[0]), weights_only=True)
    for (fixture, stage, precision), got in zip(targets, results):
        ref, tol = reference(fixture), TOLERANCE[precision]
        where = f"{fixture} -> W={world} stage {stage}"
        assert got["loaded"].endswith(f"{fixture}/global_step3_universal"), got["loaded"]
        assert got["steps"] == SAVED_AT and got["client_state"]["epoch"] == 7, where
        # the state DeepSpeed's own converter read: copied, never computed
        trained = set(got["at_load"]["master"])
        for key, ours in (("fp32", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            want = {n: t for n, t in ref["universal"][key].items() if n in trained}
            assert _worst(got["at_load"][ours], want) == 0.0, (where, key)
        assert _worst(got["frozen"], ref["frozen_at_save"]) == 0.0, where
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses_after"]))
        assert loss_gap < tol["loss"], (where, loss_gap)
        assert _worst(got["after"], ref["after"]) < tol["param"], where


def test_load_universal_needs_latest_universal(tmp_path):
    """load_universal follows latest_universal; without one the load names the file."""
    from zengine.checkpoint.formats import find
    from zengine.checkpoint import CheckpointNotFoundError

    folder = os.path.join(UNIVERSAL, "s2_fp32_w2")
    assert find(folder, None, universal=True).endswith("global_step3_universal")
    assert find(os.path.join(folder, "global_step3_universal")).endswith("_universal")
    with pytest.raises(CheckpointNotFoundError, match="latest_universal"):
        find(str(tmp_path), None, universal=True)
