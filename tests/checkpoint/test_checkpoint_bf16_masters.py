"""Checkpoints across master precisions (issue 42 item 5): fp32 masters saved, loaded into a run
with bf16 masters and states at another world size and stage, and the other way; the masters and
moments are cast as they are read (with one log line), and DeepSpeed's layout carries them too;
fp16 masters (fp16.fp16_master_weights_and_grads) through DeepSpeed's layout both ways."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

import zengine
from configs import PARITY_LR, PARITY_MICRO, parity_config
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, train_global_batch, whole_states
from zengine.checkpoint import export_deepspeed_checkpoint

MASTERS = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _config(stage: int, low: bool, rounding: str = "nearest") -> dict:
    cfg = parity_config(stage, "bf16", 1, dist.get_world_size())
    if low:
        cfg["bf16"].update(MASTERS, master_rounding=rounding)
    return cfg


def _engine(stage: int, low: bool, rounding: str = "nearest"):
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=_config(stage, low, rounding),
        model_parameters=edge_param_groups(model, PARITY_LR),
    )
    return engine


def _train(engine, steps: int, seed: int) -> list[float]:
    world = dist.get_world_size()
    batches = make_batches(steps, PARITY_MICRO * world, seed=seed)
    return [train_global_batch(engine, b, PARITY_MICRO, 1) for b in batches]


def _save(stage: int, low: bool, folder: str, rounding: str = "nearest") -> dict:
    engine = _engine(stage, low, rounding)
    _train(engine, 3, seed=1)
    engine.save_checkpoint(folder, tag="t")
    return whole_states(engine)


def _load(stage: int, low: bool, folder: str, tag="t") -> tuple[dict, list[str], list[float], dict]:
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("zengine").addHandler(handler)
    engine = _engine(stage, low)
    engine.load_checkpoint(folder, tag=tag)
    values = whole_states(engine)
    opt = engine.optimizer.optimizer
    dtypes = {str(t.dtype) for s in opt.state.values() for t in s.values() if t.dim()}
    losses = _train(engine, 2, seed=2)
    logging.getLogger("zengine").removeHandler(handler)
    masters = {str(m.dtype) for m in engine.optimizer.masters}
    return values, messages, losses, {"states": sorted(dtypes), "masters": sorted(masters)}


def _check(saved: dict, loaded: dict, low: bool) -> None:
    """Loaded values equal the saved ones cast to the loading run's dtypes: bf16 masters and moments
    are the saved fp32 ones rounded; fp32 ones are the saved bf16 ones exactly; the compute-dtype
    parameters are the same bits either way."""
    assert set(saved) == set(loaded)
    for key in saved:
        want, got = torch.tensor(saved[key]), torch.tensor(loaded[key])
        if key.startswith("param/") or not low:
            assert torch.equal(got, want), key
        else:
            assert torch.equal(got, want.to(torch.bfloat16).float()), key


CASES = [
    # (saving world, stage, bf16 masters) -> (loading world, stage, bf16 masters)
    ((2, 2, False), (3, 3, True)),
    ((3, 3, True), (2, 1, False)),
    ((2, 1, True), (3, 2, True)),
]


@pytest.mark.parametrize("saving,loading", CASES)
def test_checkpoint_across_master_precisions(tmp_path, saving, loading):
    folder = str(tmp_path / "ckpt")
    saved = spawn(_save, saving[0], saving[1], saving[2], folder)[0]
    for values, messages, losses, kinds in spawn(_load, loading[0], loading[1], loading[2], folder):
        _check(saved, values, loading[2])
        want = "torch.bfloat16" if loading[2] else "torch.float32"
        assert kinds == {"states": [want], "masters": [want]}, kinds
        # training goes on from there (the saving run's next losses: 12.7, 10.9)
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
        cast = [m for m in messages if "are cast to" in m]
        assert bool(cast) == (saving[2] != loading[2]), messages


def test_kahan_compensation_is_dropped_by_a_run_without_it(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = spawn(_save, 2, 2, True, folder, "kahan")[0]
    for values, _, losses, kinds in spawn(_load, 2, 3, True, folder):
        _check(saved, values, True)
        assert kinds["states"] == ["torch.bfloat16"]


def _export(folder: str, out: str, world: int, stage: int) -> str:
    cfg = parity_config(stage, "bf16", 1, world)
    return export_deepspeed_checkpoint(folder, out, world, cfg)


@pytest.mark.parametrize("low_save,low_load", [(True, False), (False, True), (True, True)])
def test_deepspeed_layout_both_ways(tmp_path, low_save, low_load):
    """A checkpoint of either precision exported in DeepSpeed's layout (W=2, stage 2) loads into a
    run of either precision at W=3 stage 3: the same values, cast."""
    folder, out = str(tmp_path / "ckpt"), str(tmp_path / "ds")
    saved = spawn(_save, 2, 1, low_save, folder)[0]
    exported = _export(os.path.join(folder, "t"), out, 2, 2)
    tag = os.path.basename(os.path.normpath(exported))
    for values, _, losses, _ in spawn(_load, 3, 3, low_load, os.path.dirname(exported), tag):
        _check(saved, values, low_load)
        assert all(torch.isfinite(torch.tensor(losses))), losses


def _fp16_engine(stage: int, low: bool):
    cfg = parity_config(stage, "fp16", 1, dist.get_world_size())
    cfg["fp16"]["fp16_master_weights_and_grads"] = low
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, PARITY_LR)
    )
    return engine


def _fp16_save(stage: int, low: bool, folder: str) -> dict:
    engine = _fp16_engine(stage, low)
    _train(engine, 3, seed=1)
    engine.save_checkpoint(folder, tag="t")
    return whole_states(engine)


def _fp16_load(stage: int, low: bool, folder: str, tag: str) -> tuple[dict, list[float], list]:
    engine = _fp16_engine(stage, low)
    engine.load_checkpoint(folder, tag=tag)
    values = whole_states(engine)
    masters = sorted({str(m.dtype) for m in engine.optimizer.masters})
    return values, _train(engine, 2, seed=2), masters


@pytest.mark.parametrize("low_save,low_load", [(True, False), (False, True)])
def test_fp16_masters_through_the_deepspeed_layout(tmp_path, low_save, low_load):
    """fp16 masters (fp16.fp16_master_weights_and_grads) exported in DeepSpeed's layout (fp32
    flat partitions, W=2 stage 2) load into a run with the other master precision at W=3 stage 3:
    fp16 masters exactly into fp32, fp32 ones rounded to nearest into fp16; fp32 moments and fp16
    parameters as saved."""
    folder, out = str(tmp_path / "ckpt"), str(tmp_path / "ds")
    saved = spawn(_fp16_save, 2, 1, low_save, folder)[0]
    cfg = parity_config(2, "fp16", 1, 2)
    exported = export_deepspeed_checkpoint(os.path.join(folder, "t"), out, 2, cfg)
    tag = os.path.basename(os.path.normpath(exported))
    for values, losses, masters in spawn(
        _fp16_load, 3, 3, low_load, os.path.dirname(exported), tag
    ):
        assert set(values) == set(saved)
        for key in saved:
            want, got = torch.tensor(saved[key]), torch.tensor(values[key])
            if key.startswith("master/") and low_load:
                want = want.half().float()
            assert torch.equal(got, want), key
        assert masters == (["torch.float16"] if low_load else ["torch.float32"])
        assert all(torch.isfinite(torch.tensor(losses))), losses
