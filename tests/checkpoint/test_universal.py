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


# -- out: zengine-convert to-universal ----------------------------------------------------------------


def zengine_saves(save_dir: str) -> bytes:
    """Rank body (W=2, stage 2, fp32): SAVED_AT steps, a zengine checkpoint, then CONTINUED steps."""
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = TiedLM()
    engine, *_ = zengine.initialize(
        model=model, optimizer=make_optimizer(model), config=config(2, "fp32", world)
    )
    steps = batches(SAVED_AT + CONTINUED)
    train(engine, steps[:SAVED_AT])
    engine.save_checkpoint(save_dir, client_state={"epoch": 7})
    losses = train(engine, steps[SAVED_AT:])
    after = _full_state(engine)["master"]
    engine.destroy()
    buf = io.BytesIO()
    torch.save({"losses": losses, "after": after}, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A zengine checkpoint (W=2, stage 2) converted to universal folders for DeepSpeed stages 2 and 3,
    and zengine's own continuation from it."""
    from zengine.checkpoint.export import convert
    import json

    root = tmp_path_factory.mktemp("to-universal")
    ref = torch.load(
        io.BytesIO(spawn(zengine_saves, 2, str(root / "zengine"))[0]), weights_only=True
    )
    out = {}
    for stage in (2, 3):
        cfg = root / f"ds{stage}.json"
        cfg.write_text(json.dumps(config(stage, "fp32", 2)))
        folder = root / f"universal{stage}"
        assert (
            convert.main(["to-universal", str(root / "zengine"), str(folder), "--config", str(cfg)])
            == 0
        )
        out[stage] = str(folder)
    return out, ref


def zengine_loads_universal(targets: list) -> bytes:
    world = torch.distributed.get_world_size()
    out = []
    for folder, stage in targets:
        torch.manual_seed(1)
        model = TiedLM()
        engine, *_ = zengine.initialize(
            model=model,
            optimizer=make_optimizer(model),
            config=universal_config(stage, "fp32", world),
        )
        _, client_state = engine.load_checkpoint(folder)
        steps = engine.global_steps
        losses = train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:])
        out.append(
            {
                "steps": steps,
                "client_state": client_state,
                "losses": losses,
                "after": _full_state(engine)["master"],
            }
        )
        engine.destroy()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def test_to_universal_loads_back_in_zengine(converted):
    """The universal folders written for DeepSpeed stages 2 and 3 load into zengine at W=3 (stages 3 and
    1) and continue as the run that saved continued."""
    folders, ref = converted
    assert (
        open(os.path.join(folders[2], "latest_universal")).read()
        == f"global_step{SAVED_AT}_universal"
    )
    targets = [(folders[2], 3), (folders[3], 1)]
    results = torch.load(
        io.BytesIO(spawn(zengine_loads_universal, 3, targets)[0]), weights_only=True
    )
    for (folder, stage), got in zip(targets, results):
        assert got["steps"] == SAVED_AT and got["client_state"] == {"epoch": 7}, folder
        gap = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert gap < TOLERANCE["fp32"]["loss"], (folder, gap)
        assert _worst(got["after"], ref["after"]) < TOLERANCE["fp32"]["param"], folder


def _deepspeed_python() -> str:
    """A Python with DeepSpeed (ZENGINE_DEEPSPEED_PYTHON, else /tmp/dsv's); skips the test without one."""
    import subprocess

    python = os.environ.get("ZENGINE_DEEPSPEED_PYTHON", "/tmp/dsv/bin/python")
    if not os.path.isfile(python):
        pytest.skip(f"no Python with DeepSpeed at {python} (set ZENGINE_DEEPSPEED_PYTHON)")
    probe = subprocess.run(
        [python, "-c", "import deepspeed"],
        capture_output=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import deepspeed")
    return python


def test_deepspeed_loads_to_universal(converted, tmp_path):
    """DeepSpeed 0.19.8 itself loads zengine's universal folders with load_universal (stages 2 and 3,
    W=1) and continues as zengine's run continued (only when a Python with DeepSpeed is at hand).
    DeepSpeed's stage 3 gives every param group the hyper-parameters of group 0 when it loads a universal
    checkpoint (its stage3.py, whatever wrote the folder): there its first loss (the loaded weights) is
    held to the tolerance, and the groups' weight decays are checked to be group 0's."""
    import subprocess

    python = _deepspeed_python()
    folders, ref = converted
    output = tmp_path / "deepspeed.pt"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_universal_load.py")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # DeepSpeed's environment, not zengine's
    run = subprocess.run(
        [python, script, str(output), "1", folders[2], "2", folders[3], "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stage2, stage3 = torch.load(output, weights_only=True)
    for stage, got in ((2, stage2), (3, stage3)):
        assert got["steps"] == SAVED_AT, stage
        assert abs(got["losses"][0] - ref["losses"][0]) / ref["losses"][0] < 1e-6, stage
    gap = max(abs(a - b) / abs(b) for a, b in zip(stage2["losses"], ref["losses"]))
    assert gap < TOLERANCE["fp32"]["loss"], gap
    assert _worst(stage2["after"], ref["after"]) < TOLERANCE["fp32"]["param"]
    assert stage2["weight_decay"] == [0.1, 0.0] and stage3["weight_decay"] == [0.1, 0.1]
