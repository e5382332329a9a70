"""DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed/, written by DeepSpeed itself: make_fixtures.py) load
into zengine at other world sizes and stages and continue as DeepSpeed continued; zengine writes them back.

Every fixture records what DeepSpeed reported at the save (fp32 masters through ``safe_get_full_fp32_param``;
masters, Adam moments and step through its offline ``ds_to_universal`` converter) and what it trained in the
CONTINUED steps after the save. Loading must reproduce the recorded state exactly (the bytes are copied, never
computed), and zengine's continuation must track DeepSpeed's within the rounding of the two engines' gradient
reductions (see the tolerances below).
"""
from __future__ import annotations

import importlib.util
import io
import os

import pytest
import torch

import zengine
from zengine.checkpoint.ds_export import export_deepspeed_checkpoint
from deepspeed_runs import CONTINUED, SAVED_AT, TiedLM, batches, config, make_optimizer, train
from harness import spawn

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed")
# fp32: both engines compute the same AdamW on the same summed gradients; only the order of the ranks'
# gradient sums and of the clipping norm differs (float rounding, ~1e-7 relative), which three steps at
# lr 1e-2 keep below 1e-5. bf16: the forward runs in bf16 in both, but DeepSpeed reduces bf16 gradients
# while zengine accumulates and reduces them in fp32, and a master differing by one bf16 ulp rounds the
# next forward's weights apart: losses agree to 2e-2 relative and masters to 2e-3 absolute (lr x steps is
# 3e-2: a systematic error, a lost moment or a wrong step count, shows at that scale).
TOLERANCE = {"fp32": {"loss": 1e-5, "param": 1e-5}, "bf16": {"loss": 2e-2, "param": 2e-3}}


def reference(name: str) -> dict:
    return torch.load(os.path.join(FIXTURES, name, "reference.pt"), weights_only=True)


def _full_state(engine) -> dict:
    """zengine's fp32 masters and Adam moments of every trained parameter, whole, by name."""
    out = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out["master"][name] = zengine.utils.safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[key][name] = zengine.utils.safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    return out


def load_and_continue(targets: list, save_dir: str) -> bytes:
    """Rank body: for each (fixture, stage), a fresh engine (other initial weights) loads DeepSpeed's
    checkpoint, saves it as a zengine checkpoint in ``save_dir/<fixture>``, then trains CONTINUED steps."""
    world = torch.distributed.get_world_size()
    out = []
    for fixture, stage, precision in targets:
        torch.manual_seed(1)
        model = TiedLM()
        engine, *_ = zengine.initialize(model=model, optimizer=make_optimizer(model),
                                        config=config(stage, precision, world))
        loaded, client_state = engine.load_checkpoint(os.path.join(FIXTURES, fixture))
        at_load = _full_state(engine)
        with torch.no_grad(), engine.summon_full_params(writeback=False):
            frozen = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters() if not p.requires_grad}
            tied = engine.module.lm_head.weight is engine.module.wte.weight
        counters = (engine.global_steps, engine.global_samples)
        engine.save_checkpoint(os.path.join(save_dir, fixture))
        losses = train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:])
        out.append({"loaded": loaded, "client_state": client_state, "at_load": at_load, "frozen": frozen,
                    "tied": tied, "counters": counters, "losses": losses, "after": _full_state(engine)["master"]})
        engine.destroy()
    buf = io.BytesIO()  # as bytes: tensors through the result queue would each hold a shared-memory handle
    torch.save(out, buf)
    return buf.getvalue()


def _results(raw: bytes):
    return torch.load(io.BytesIO(raw), weights_only=True)


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    # flattened: DeepSpeed's universal files of a stage-3 checkpoint hold each parameter 1-D
    assert all(got[n].numel() == want[n].numel() for n in want), {n: (got[n].shape, want[n].shape) for n in want}
    return max((got[n].float().reshape(-1) - want[n].float().reshape(-1)).abs().max().item() for n in want)


# world size -> [(fixture, stage)]: one process group per world size; every fixture loads into another
# world size and stage, and each zengine stage and world size receives fp32 and bf16 checkpoints
CASES = {1: [("s3_bf16_w2", 1), ("s2_fp32_w2", 2)],
         2: [("s3_fp32_w2", 1), ("s2_bf16_w2", 3), ("s2_fp32_w3", 3), ("s3_bf16_w3", 2)],
         3: [("s1_fp32_w2", 3), ("s1_bf16_w2", 2)]}


@pytest.mark.parametrize("world", sorted(CASES))
def test_deepspeed_checkpoint_continues(world, tmp_path):
    refs = {fixture: reference(fixture) for fixture, _ in CASES[world]}
    targets = [(fixture, stage, refs[fixture]["precision"]) for fixture, stage in CASES[world]]
    for (fixture, stage, precision), got in zip(targets, _results(spawn(load_and_continue, world, targets, str(tmp_path))[0])):
        ref, tol = refs[fixture], TOLERANCE[precision]
        where = f"{fixture} -> zengine W={world} stage {stage}"
        trained = set(ref["at_save"])
        assert got["loaded"] == os.path.join(FIXTURES, fixture, ref["tag"]), where
        assert got["client_state"] == ref["client_state"], where
        assert got["counters"] == (SAVED_AT, SAVED_AT * 6), where
        # what DeepSpeed saved arrives exactly: masters (both of DeepSpeed's readings), moments, frozen weights
        assert _worst(got["at_load"]["master"], ref["at_save"]) == 0.0, where
        for key, ds_key in (("master", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            universal = {n: t for n, t in ref["universal"][ds_key].items() if n in trained}
            assert _worst(got["at_load"][key], universal) == 0.0, f"{where}: {key}"
        assert _worst(got["frozen"], ref["frozen_at_save"]) == 0.0, where
        assert got["tied"], where
        # and trains on as DeepSpeed did
        assert got["losses"] == pytest.approx(ref["losses_after"], rel=tol["loss"]), where
        worst = _worst(got["after"], ref["after"])
        assert worst <= tol["param"], f"{where}: masters after {CONTINUED} steps differ by {worst:.3g}"


def deepspeed_continue(targets: list) -> bytes:
    """Rank body under DeepSpeed itself: load each export of zengine's, read its masters, train on."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    out = []
    for path, stage, precision in targets:
        torch.manual_seed(1)
        model = TiedLM()
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model),
                                          config=config(stage, precision, world))
        loaded, _ = engine.load_checkpoint(os.path.dirname(path))  # the save_dir, with its 'latest'
        assert loaded is not None, f"DeepSpeed found no checkpoint in {os.path.dirname(path)}"
        masters = {n: deepspeed.utils.safe_get_full_fp32_param(p).detach().cpu().clone()
                   for n, p in engine.module.named_parameters() if p.requires_grad}
        out.append({"masters": masters, "steps": engine.global_steps,
                    "losses": train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:])})
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed: run this file with the venv that make_fixtures.py describes")
def test_deepspeed_continues_from_zengine_export(tmp_path):
    """DeepSpeed 0.19.8 loads zengine's export (other stages than the checkpoint it came from) and trains on as
    it trained on from its own checkpoint."""
    targets = [("s3_fp32_w2", 1, "fp32"), ("s2_bf16_w2", 2, "bf16")]
    zengine_runs = _results(spawn(load_and_continue, 2, targets, str(tmp_path))[0])
    exports = []
    for (fixture, _, precision), ds_stage in zip(targets, (2, 1)):  # bf16 stage 1: DeepSpeed's bf16 optimizer
        exports.append((export_deepspeed_checkpoint(str(tmp_path / fixture), str(tmp_path / f"ds-{fixture}"), 2,
                                                    config(ds_stage, precision, 2)), ds_stage, precision))
    ran = _results(spawn(deepspeed_continue, 2, exports, env={"DS_ACCELERATOR": "cpu"})[0])
    for (fixture, _, precision), zen, ds in zip(targets, zengine_runs, ran):
        ref = reference(fixture)
        assert ds["steps"] == SAVED_AT, fixture
        assert _worst(ds["masters"], zen["at_load"]["master"]) == 0.0, fixture
        assert ds["losses"] == pytest.approx(ref["losses_after"], rel=TOLERANCE[precision]["loss"]), fixture
