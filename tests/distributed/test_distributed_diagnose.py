"""Ranks out of step and stopped ranks are named, not hung (zengine/distributed/diagnose.py, collectives.Pending).

A rank that skips a whole step agrees with its peers on every count until the end (its collectives
pair with the peers' next ones), so it is caught where the ranks' ends differ: the rank left waiting
sees that a peer finished, and both ranks fail the job naming each rank's steps. A stopped rank is
named when comm_timeout expires. A slow rank is not a failure.
"""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import free_port, spawn
from zengine.distributed import collectives as comm
from zengine import CollectiveMismatchError, CollectiveTimeoutError, FetchOrderError
from zengine.distributed.diagnose import is_backend_failure

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))

SKIPPING_JOB = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch import nn
    import zengine

    stage, gas = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_debug_fetch_order": stage == 3}}
    engine, *_ = zengine.initialize(model=model, config=config)
    rank = dist.get_rank()
    for i in range(4 * gas):
        if rank == 1 and i == 2 * gas - 1:  # rank 1 skips one micro-batch (a short data loader)
            continue
        engine.backward(engine(torch.randn(2, 16)).pow(2).mean())
        engine.step()
    print(f"rank {rank} left its loop after {engine.global_steps} steps", flush=True)
    """
)


def _launch(tmp_path, script: str, *args: str, timeout: float = 120):
    path = tmp_path / "job.py"
    path.write_text(script)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PACKAGE_ROOT, env.get("PYTHONPATH")] if p)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(path),
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("stage, gas", [(0, 1), (2, 2), (3, 1)])
def test_a_rank_skipping_a_step_fails_the_job_on_every_rank(tmp_path, stage, gas):
    start = time.monotonic()
    done = _launch(tmp_path, SKIPPING_JOB, str(stage), str(gas))
    elapsed = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    # rank 0, left waiting in its last step's first collective, names what happened
    assert "RanksOutOfStepError: zengine: rank 0 was waiting in the collective" in out, out
    assert (
        f"rank 1: finished and left the job after 3 optimizer step(s) ({4 * gas - 1} micro-step(s))"
        in out
    ), out
    assert (
        "rank 0 (this rank): failed in the collective" in out and f"in micro-step {4 * gas}" in out
    ), out
    # and rank 1, whose own loop ended normally, fails the job too rather than exiting 0 (or, if the
    # launcher stops it first on rank 0's failure, it is listed as stopped: never as a success)
    assert "zengine: rank 1 finished, but the job did not: rank(s) [0] failed" in out or re.search(
        r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -15", out
    ), out
    # both at once: not at the collective timeout (300 s by default)
    assert elapsed < 60, f"the job took {elapsed:.0f} s to fail"


def _stopped_rank(sleep_s: float, timeout_s: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "comm_timeout": timeout_s,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zengine.initialize(model=model, config=config)
    rank = dist.get_rank()
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    if rank == 1:
        time.sleep(sleep_s)  # stopped (SIGSTOP, a debugger, a long stall) inside step 2
    start = time.monotonic()
    try:
        engine.backward(engine(torch.randn(2, 8)).sum())
        engine.step()
    except CollectiveTimeoutError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_stopped_rank_is_named_when_comm_timeout_expires():
    results = spawn(_stopped_rank, 2, 12.0, 2.0, timeout=120)
    message, waited = results[0]
    assert message is not None, "rank 0 did not raise CollectiveTimeoutError"
    assert "did not complete on rank 0" in message and "rank(s) [1] never arrived" in message, (
        message
    )
    assert "the collective all_reduce of a [" in message, (
        message
    )  # the gradient bucket it waited in
    assert (
        "rank 0 (this rank): failed in the collective" in message and "in micro-step 2" in message
    ), message
    assert "rank 1: no report within" in message, message
    assert waited < 11, (
        f"rank 0 waited {waited:.0f} s: longer than comm_timeout plus the grace for reports"
    )
    # rank 1 wakes into a collective nobody else will join, and gets a diagnosed error at once, not a hang.
    # (Here rank 0's record left with rank 0, which hosted the store; under a launcher the store outlives it.)
    message, waited = results[1]
    assert message is not None and "did not complete on rank 1" in message, message
    assert waited < 11, f"rank 1 waited {waited:.0f} s"


def _slow_peer(delay: float):
    if dist.get_rank() == 1:
        time.sleep(delay)  # several wait slices: a slow rank must not be taken for a departed one
    t = torch.full((5,), float(dist.get_rank() + 1))
    comm.all_reduce_sum(t)
    rows = torch.zeros(dist.get_world_size(), 3)
    rows[dist.get_rank()] = dist.get_rank() + 10
    for w in comm.all_gather_rows(rows, dist.get_rank(), async_op=True):
        w.wait()
    return t.tolist(), rows.tolist()


def test_a_slow_rank_is_waited_for():
    for t, rows in spawn(_slow_peer, 2, 3.5):
        assert t == [3.0] * 5
        assert rows == [[10.0] * 3, [11.0] * 3]


def test_program_errors_are_not_taken_for_communication_failures():
    assert is_backend_failure(
        RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    )
    assert is_backend_failure(
        RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    )
    assert not is_backend_failure(
        comm.WrongDeviceError("zengine.distributed.collectives.all_reduce_sum: a cpu tensor ...")
    )
    assert not is_backend_failure(ValueError("shapes do not match"))
    assert not is_backend_failure(CollectiveTimeoutError("already diagnosed"))


class _SideBranch(nn.Module):
    """``b``'s output reaches the loss on every rank (``zero_out``: times 0 on rank 1) or, detached, not on rank 1."""

    def __init__(self, zero_out: bool):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.zero_out = zero_out

    def forward(self, x):
        h = self.a(x)
        side = self.b(h)
        if dist.get_rank() == 1:
            side = side * 0 if self.zero_out else side.detach()
        return (self.c(h) + side).square().mean()


def side_branch_run(zero_out: bool):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zengine.initialize(model=_SideBranch(zero_out), config=config)
    start = time.monotonic()
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 8)))
            engine.step()
    except (CollectiveTimeoutError, CollectiveMismatchError, FetchOrderError) as e:
        return str(e), time.monotonic() - start
    return "trained", time.monotonic() - start


def test_ranks_waiting_in_different_collectives_are_named_in_seconds():
    """Stage 3, a module detached on one rank: the other rank gathers it again in backward alone. Both ranks
    used to wait until comm_timeout (300 s); now the collectives' identity check (identity.py) names
    each rank's collective at once, before either moves (the deadlock detection of waiting.py
    names what gets past it)."""
    for message, seconds in spawn(side_branch_run, 2, False, timeout=120):
        assert "made different collectives" in message, message
        assert "rank 0" in message and "rank 1" in message and "stage-3 gather" in message, message
        assert "multiply by 0 rather than detach" in message, message
        assert seconds < 30, f"named after {seconds:.0f} s"
    # the way out the message gives trains
    assert [m for m, _ in spawn(side_branch_run, 2, True, timeout=120)] == ["trained", "trained"]
