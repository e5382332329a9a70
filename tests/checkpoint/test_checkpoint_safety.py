"""Crash safety and bad input: kill -9 during a save, a full disk, a truncated or corrupt file, another model,
a missing tag (with missing_ok; test_checkpoint_missing.py has the rest)."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from torch import nn

import zengine
from checkpoint_runs import LR, BufferedNet, batches, config, full_params, make_engine, train
from harness import spawn
from models import DIM, HIDDEN, edge_param_groups
from zengine.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    get_fp32_state_dict_from_zero_checkpoint,
)
from zengine.checkpoint.native import tensorfile

HERE = os.path.dirname(os.path.abspath(__file__))

KILLED_SAVE = textwrap.dedent("""
    import sys, time
    import torch, zengine
    import checkpoint_runs as runs
    from zengine.checkpoint.native import tensorfile
    save_dir, params_file = sys.argv[1:3]
    zengine.init_distributed()
    engine = runs.make_engine(runs.config(1), seed=0)
    runs.train(engine, runs.batches(1))
    engine.save_checkpoint(save_dir, tag="a")
    torch.save(runs.full_params(engine), params_file)
    runs.train(engine, runs.batches(2)[1:])
    write = tensorfile.write_bytes
    def slow(f, data):
        print("WRITING", flush=True)
        time.sleep(120)
        write(f, data)
    tensorfile.write_bytes = slow
    engine.save_checkpoint(save_dir, tag="a")  # the same tag again: killed half way
""")


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    save_dir, params_file = str(tmp_path / "ckpt"), str(tmp_path / "params.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)] + sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, save_dir, params_file],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        for line in child.stdout:
            if "WRITING" in line:
                break
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert any(n.startswith(".tmp-a-") for n in os.listdir(save_dir)), (
        "the child was not killed during the save"
    )
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read() == "a"
    restored = get_fp32_state_dict_from_zero_checkpoint(save_dir)  # verifies every checksum
    expected = torch.load(params_file)
    assert all(torch.equal(restored[n], p) for n, p in expected.items())


class PlusNet(BufferedNet):
    """BufferedNet with a layer added (what load_module_strict=False lets load)."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(2, 2)


class WiderNet(BufferedNet):
    """BufferedNet with one layer resized and one added."""

    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(HIDDEN + 1, DIM)
        self.extra = nn.Linear(2, 2)


def _expect(exc_type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


def bad_inputs(root: str) -> dict:
    rank = dist.get_rank()
    out = {}
    engine = make_engine(config(2), seed=0)
    train(engine, batches(1))
    out["no_latest"] = engine.load_checkpoint(os.path.join(root, "nothing-here"), missing_ok=True)
    out["no_tag"] = engine.load_checkpoint(root, tag="nope", missing_ok=True)
    engine.save_checkpoint(root, tag="good")

    write = tensorfile.write_bytes
    if rank == 1:

        def full(f, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        tensorfile.write_bytes = full
    try:
        out["full_disk"] = _expect(CheckpointSaveError, engine.save_checkpoint, root, tag="full")
    finally:
        tensorfile.write_bytes = write
    out["listing"] = sorted(os.listdir(root))

    model = WiderNet()
    other, *_ = zengine.initialize(
        model=model, config=config(2), model_parameters=edge_param_groups(model, LR)
    )
    out["mismatch"] = _expect(CheckpointMismatchError, other.load_checkpoint, root, tag="good")
    # DeepSpeed's load_module_strict=False: a reshaped parameter still raises; one the checkpoint lacks keeps
    # its value, one only the checkpoint has is ignored, and training goes on
    out["lenient_reshaped"] = _expect(
        CheckpointMismatchError, other.load_checkpoint, root, tag="good", load_module_strict=False
    )
    model = PlusNet()
    plus, *_ = zengine.initialize(
        model=model, config=config(2), model_parameters=edge_param_groups(model, LR)
    )
    before = full_params(plus)
    out["lenient_path"] = (
        plus.load_checkpoint(root, tag="good", load_module_strict=False)[0] is not None
    )
    loaded, saved = full_params(plus), full_params(engine)
    out["lenient_same"] = all(torch.equal(loaded[n], saved[n]) for n in saved)
    extra = [n for n in loaded if n.startswith("extra.")]
    out["lenient_kept"] = len(extra) == 2 and all(torch.equal(loaded[n], before[n]) for n in extra)
    out["lenient_trains"] = len(train(plus, batches(1))) == 1

    if rank == 0:
        for tag in ("cut", "flip"):
            shutil.copytree(os.path.join(root, "good"), os.path.join(root, tag))
        victim = os.path.join(root, "cut", "rank_00001.safetensors")
        os.truncate(victim, os.path.getsize(victim) - 100)
        victim = os.path.join(root, "flip", "rank_00001.safetensors")
        with open(victim, "r+b") as f:
            header = int.from_bytes(f.read(8), "little")
            f.seek(8 + header + 10)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    out["truncated"] = _expect(CheckpointError, engine.load_checkpoint, root, tag="cut")
    out["corrupt"] = _expect(CheckpointError, engine.load_checkpoint, root, tag="flip")
    out["good_after"] = engine.load_checkpoint(root, tag="good")[0] is not None
    return out


def test_bad_inputs(tmp_path):
    for rank, out in enumerate(spawn(bad_inputs, 2, str(tmp_path))):
        assert out["no_latest"] == (None, None) and out["no_tag"] == (None, None)
        assert "No space left on device" in out["full_disk"] and "untouched" in out["full_disk"]
        assert out["listing"] == ["good", "latest", "zero_to_fp32.py", "zero_to_torch.py"], (
            "a failed save left files behind or moved 'latest'"
        )
        for expected in (
            "fc2.weight: shape (23, 41) in the checkpoint, (23, 42) in the model",
            "missing from the checkpoint: extra.weight, extra.bias",
        ):
            assert expected in out["mismatch"], out["mismatch"]
        assert (
            "fc2.weight: shape (23, 41) in the checkpoint, (23, 42) in the model"
            in out["lenient_reshaped"]
        )
        assert "missing from the checkpoint" not in out["lenient_reshaped"]
        assert (
            out["lenient_path"]
            and out["lenient_same"]
            and out["lenient_kept"]
            and out["lenient_trains"]
        ), out
        assert "rank_00001.safetensors" in out["truncated"] and "truncated" in out["truncated"], (
            out["truncated"]
        )
        assert "rank_00001.safetensors" in out["corrupt"] and "checksum" in out["corrupt"], out[
            "corrupt"
        ]
        assert out["good_after"]
