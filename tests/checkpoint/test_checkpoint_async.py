"""Asynchronous checkpoints (checkpoint/native/background.py): ``save_checkpoint(async_save=True)`` and the config's
``checkpoint.writer.decoupled`` return after a copy to host memory; training goes on while a thread writes;
the checkpoint is the state at the save, not at the wait; it appears whole or not at all (kill -9 during the
background write keeps the previous one); a failed write raises on every rank at the wait."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import zengine
from checkpoint_runs import as_lists, batches, config, full_params, make_engine, train
from harness import spawn
from zengine.checkpoint import CheckpointSaveError, get_fp32_state_dict_from_zero_checkpoint
from zengine.checkpoint.native import tensorfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _async_run(stage: int, save_dir: str) -> dict:
    cfg = config(stage, scheduler=True)
    engine = make_engine(cfg, seed=0)
    data = batches(4)
    train(engine, data[:2])
    at_save = full_params(engine)
    engine.save_checkpoint(save_dir, tag="async", async_save=True)
    in_flight = zengine.checkpoint.native.background.in_flight(engine)
    losses_after = train(engine, data[2:])  # the step goes on while the thread writes
    engine.wait_for_checkpoint()
    resumed = make_engine(
        cfg, seed=1
    )  # other initial weights: everything must come from the checkpoint
    path, _ = resumed.load_checkpoint(save_dir)
    same_at_save = max((full_params(resumed)[n] - p).abs().max().item() for n, p in at_save.items())
    resumed_losses = train(resumed, data[2:])
    # the decoupled writer from the config: the same, without the keyword
    cfg_decoupled = {**cfg, "checkpoint": {"writer": {"decoupled": True}}}
    other = make_engine(cfg_decoupled, seed=0)
    train(other, data[:2])
    other.save_checkpoint(save_dir, tag="decoupled")
    decoupled_in_flight = zengine.checkpoint.native.background.in_flight(other)
    other.destroy()  # waits, and publishes
    return {
        "in_flight": in_flight,
        "path": os.path.basename(path),
        "same_at_save": same_at_save,
        "losses": losses_after,
        "resumed_losses": resumed_losses,
        "decoupled_in_flight": decoupled_in_flight,
        "latest": open(os.path.join(save_dir, "latest")).read(),
    }


@pytest.mark.parametrize(
    "stage,world", [(3, 3)]
)  # (the save path is stage-independent; stage 2 in the others)
def test_async_save_is_the_state_at_the_save(stage, world, tmp_path):
    for out in spawn(_async_run, world, stage, str(tmp_path)):
        assert out["in_flight"] and out["decoupled_in_flight"], out
        assert out["path"] == "async" and out["same_at_save"] == 0.0, (
            out
        )  # bit-exact, though training went on
        assert out["resumed_losses"] == out["losses"], out  # and it resumes to the same steps
        assert out["latest"] == "decoupled", out


def _failing_run(save_dir: str) -> str:
    engine = make_engine(config(2), seed=0)
    train(engine, batches(1))
    engine.save_checkpoint(save_dir, tag="good")
    if dist.get_rank() == 1:  # a full disk on one rank, in its background thread

        def full(f, data):
            raise OSError(28, "No space left on device")

        tensorfile.write_bytes = full
    engine.save_checkpoint(save_dir, tag="bad", async_save=True)
    train(engine, batches(2)[1:])
    try:
        engine.wait_for_checkpoint()
    except CheckpointSaveError as e:
        return str(e)
    return "no error"


def test_failed_background_write_raises_on_every_rank_and_keeps_the_previous(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    for message in spawn(_failing_run, 2, save_dir):
        assert "rank 1 writing its file" in message and "No space left on device" in message, (
            message
        )
    assert open(os.path.join(save_dir, "latest")).read() == "good"
    assert not [
        n for n in os.listdir(save_dir) if n.startswith(".tmp-")
    ]  # the staging folder is gone
    get_fp32_state_dict_from_zero_checkpoint(save_dir)  # whole, checksums verified


KILLED_ASYNC_SAVE = textwrap.dedent("""
    import sys, threading
    import torch, zengine
    import checkpoint_runs as runs
    from zengine.checkpoint.native import tensorfile
    save_dir, params_file = sys.argv[1:3]
    zengine.init_distributed()
    engine = runs.make_engine(runs.config(1), seed=0)
    runs.train(engine, runs.batches(1))
    engine.save_checkpoint(save_dir, tag="a")
    torch.save(runs.full_params(engine), params_file)
    write, stuck = tensorfile.write_bytes, threading.Event()
    def slow(f, data):
        print("WRITING", flush=True)
        stuck.wait()  # (forever: the test kills the process)
        write(f, data)
    tensorfile.write_bytes = slow
    engine.save_checkpoint(save_dir, tag="b", async_save=True)
    runs.train(engine, runs.batches(2)[1:])
    print("TRAINED", flush=True)  # the step went on during the write
    stuck.wait()
""")


def test_kill_during_background_write_keeps_previous_checkpoint(tmp_path):
    save_dir, params_file = str(tmp_path / "ckpt"), str(tmp_path / "params.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)] + sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_ASYNC_SAVE, save_dir, params_file],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    seen = []
    try:
        for line in child.stdout:
            seen.append(line.strip())
            if "TRAINED" in line:
                break
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert seen[-2:] == ["WRITING", "TRAINED"], seen
    assert any(n.startswith(".tmp-b-") for n in os.listdir(save_dir)), (
        "the child was not killed during the write"
    )
    assert open(os.path.join(save_dir, "latest")).read() == "a"
    restored = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    expected = torch.load(params_file)
    assert all(torch.equal(restored[n], p) for n, p in expected.items())
