"""Elastic restarts (`zengine --max_restarts N`): a rank killed with SIGKILL mid-run, the job restarts by
itself, resumes from the latest checkpoint (``auto_resume``) and ends with exactly the parameters of an
uninterrupted run. The job is the main job, examples/train_gpt.py, checkpointing every few steps."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zengine
from zengine.checkpoint import get_fp32_state_dict_from_zero_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))
STEPS, EVERY, KILL_AT = 12, 4, 6

# The main job, with one change for the test: on the first attempt, rank 1 kills itself (SIGKILL, no
# clean-up) right after optimizer step KILL_AT, between the checkpoints of steps 4 and 8.
KILLING_WRAPPER = textwrap.dedent(f"""
    import os, runpy, signal, sys
    import zengine.engine.engine
    step = zengine.engine.Engine.step
    def killing_step(self):
        step(self)
        if (os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and self.global_rank == 1
                and self.global_steps == {KILL_AT}):
            os.kill(os.getpid(), signal.SIGKILL)
    zengine.engine.Engine.step = killing_step
    sys.argv[0] = {os.path.join(REPO, "examples", "train_gpt.py")!r}
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def _launch(cwd, script, config, save_dir, *extra):
    from harness import free_port

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH")] if p)
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "zengine.launcher.runner",
            "--master_port",
            str(free_port()),
            "--num_procs",
            "2",
            *extra,
            script,
            "--deepspeed_config",
            config,
            "--steps",
            str(STEPS),
            "--print_every",
            str(EVERY),
            "--save_dir",
            save_dir,
            "--save_every",
            str(EVERY),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# (stage 1 restarts through the same sharded-state checkpoint path as stage 2, and stage 0 through the simplest
# one (every rank whole; its resume is exact in tests/checkpoint): left out to keep the suite short)
# stage 3 with parameters on the CPU and Adam on NVMe: it restores the most (the restart itself does not
# depend on the stage; stage 2 and plain stage 3 cost 40 s of a suite near its time limit)
@pytest.mark.parametrize("config", ["zero3_offload_nvme.json"])
def test_killed_rank_restarts_and_ends_like_an_uninterrupted_run(tmp_path, config):
    config = os.path.join(REPO, "configs", config)
    plain = _launch(
        tmp_path, os.path.join(REPO, "examples", "train_gpt.py"), config, str(tmp_path / "plain")
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    wrapper = tmp_path / "killing_train_gpt.py"
    wrapper.write_text(KILLING_WRAPPER)
    elastic = _launch(
        tmp_path, str(wrapper), config, str(tmp_path / "elastic"), "--max_restarts", "1"
    )
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    assert "exitcode: -9" in elastic.stderr  # a rank really died, and the agent restarted the job
    assert (
        f"resumed from {tmp_path / 'elastic' / 'global_step4'} at step 4"
        in elastic.stderr + elastic.stdout
    )
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "plain"))
    b = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "elastic"))
    assert open(tmp_path / "elastic" / "latest").read().strip() == f"global_step{STEPS}"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (
        "the restarted run ended elsewhere"
    )


def test_restarts_use_the_c10d_rendezvous():
    from zengine.launcher.options import build_parser
    from zengine.launcher.plan import plan_launch, torchrun_argv

    args = build_parser().parse_args(
        ["--num_procs", "2", "--max_restarts", "2", "--master_port", "29999", "x.py"]
    )
    plan = plan_launch(args, None, 2, False)
    argv = torchrun_argv(plan, plan.nodes[0], args)
    assert argv[argv.index("--rdzv_backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv_endpoint") + 1].endswith(":29999")
    args = build_parser().parse_args(["--num_procs", "2", "x.py"])
    plan = plan_launch(args, None, 2, False)
    assert "static" in torchrun_argv(plan, plan.nodes[0], args)


def test_two_launchers_as_two_nodes_train_like_one_four_rank_launch(tmp_path):
    """Per-node launch as DeepSpeed users write it (``--num_nodes 2 --node_rank i``), two launcher
    processes on this machine, ends with the parameters of one 4-rank launch, bit for bit."""
    from harness import free_port

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH")] if p)
    env.pop("OMP_NUM_THREADS", None)
    job = [
        os.path.join(REPO, "examples", "train_gpt.py"),
        "--deepspeed_config",
        os.path.join(REPO, "configs", "zero2.json"),
        "--steps",
        "4",
        "--print_every",
        "4",
    ]
    launcher = [sys.executable, "-m", "zengine.launcher.runner"]
    one = subprocess.run(
        [
            *launcher,
            "--master_port",
            str(free_port()),
            "--num_procs",
            "4",
            *job,
            "--save_dir",
            str(tmp_path / "one"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                *launcher,
                "--num_nodes",
                "2",
                "--node_rank",
                str(i),
                "--num_procs",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                *job,
                "--save_dir",
                str(tmp_path / "two"),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), [o[1][-2000:] for o in outs]
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "one"))
    b = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "two"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The main job again; in the launcher started with ZENGINE_TEST_DOOMED_NODE=1, on the first attempt, local
# rank 0 kills its node (the launcher, which is the node's elastic agent, then itself; its sibling rank dies
# of the lost peers) right after optimizer step KILL_AT: the machine is gone, not restarted.
NODE_KILLING_WRAPPER = textwrap.dedent(f"""
    import os, runpy, signal, sys
    import zengine.engine.engine
    step = zengine.engine.Engine.step
    def node_killing_step(self):
        step(self)
        if (os.environ.get("ZENGINE_TEST_DOOMED_NODE") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
                and os.environ.get("LOCAL_RANK") == "0" and self.global_steps == {KILL_AT}):
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
    zengine.engine.Engine.step = node_killing_step
    sys.argv[0] = {os.path.join(REPO, "examples", "train_gpt.py")!r}
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def _losses(output: str) -> dict[int, float]:
    """The main job's printed mean losses by optimizer step, from the last time each step was printed."""
    losses = {}
    for line in output.splitlines():
        if line.startswith("step ") and "| loss " in line:
            fields = line.split("|")
            losses[int(fields[0].split()[1])] = float(fields[1].split()[1])
    return losses


# (Stage 2 with train_batch_size ran here too, 55 s: the same restart path; the global batch a world size gets
# from train_batch_size or the elasticity section is tested without launching in tests/config/test_elasticity.py.)
@pytest.mark.parametrize("stage, batch", [(3, "elasticity")])
def test_lost_node_continues_at_the_smaller_world_size(tmp_path, stage, batch):
    """Two launchers as two machines (``--nnodes 1:2``, 2 ranks each): one machine dies after step 6;
    the other goes on alone from the step-4 checkpoint at world size 2, keeping the global batch of
    32 through gradient accumulation (2 instead of 1), and its losses and final parameters follow an
    uninterrupted 4-rank run within fp32 rounding (the same samples per step, summed in another order).
    The global batch is fixed by train_batch_size, or chosen by DeepSpeed's elasticity section."""
    from harness import free_port

    with open(os.path.join(REPO, "configs", f"zero{stage}.json")) as f:
        config = json.load(f)
    del config[
        "gradient_accumulation_steps"
    ]  # derived from the world size: 32 = 8 x W x accumulation
    config["comm_timeout"] = 30
    if (
        batch == "elasticity"
    ):  # of the batches <= 32 made of micro batches of 8, 32 suits the most world
        # sizes in 2..4: 2 (accumulation 2) and 4 (accumulation 1); 24 suits only 3, 16 only 2
        del config["train_micro_batch_size_per_gpu"]
        config["elasticity"] = {
            "enabled": True,
            "max_train_batch_size": 32,
            "micro_batch_sizes": [8],
            "min_gpus": 2,
            "max_gpus": 4,
        }
    else:
        config["train_batch_size"] = 32
    config_path = tmp_path / "elastic.json"
    config_path.write_text(json.dumps(config))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH")] if p)
    env.pop("OMP_NUM_THREADS", None)
    job = [
        "--deepspeed_config",
        str(config_path),
        "--steps",
        str(STEPS),
        "--print_every",
        "2",
        "--save_every",
        str(EVERY),
    ]
    launcher = [sys.executable, "-m", "zengine.launcher.runner"]
    plain = subprocess.run(
        [
            *launcher,
            "--master_port",
            str(free_port()),
            "--num_procs",
            "4",
            os.path.join(REPO, "examples", "train_gpt.py"),
            *job,
            "--save_dir",
            str(tmp_path / "plain"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]

    wrapper = tmp_path / "node_killing_train_gpt.py"
    wrapper.write_text(NODE_KILLING_WRAPPER)
    elastic = [
        *launcher,
        "--nnodes",
        "1:2",
        "--num_procs",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "--max_restarts",
        "1",
        "--rdzv_conf",
        "last_call_timeout=10",
        str(wrapper),
        *job,
        "--save_dir",
        str(tmp_path / "elastic"),
    ]
    survivor = subprocess.Popen(
        elastic,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    time.sleep(1)  # the survivor hosts the rendezvous store, as a machine that stays up should
    doomed = subprocess.Popen(
        elastic,
        cwd=tmp_path,
        env={**env, "ZENGINE_TEST_DOOMED_NODE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = survivor.communicate(timeout=400)
        doomed.communicate(timeout=60)
    finally:
        for proc in (survivor, doomed):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert doomed.returncode == -signal.SIGKILL, (
        "the doomed machine's launcher did not die as planned"
    )
    assert survivor.returncode == 0, err[-4000:]
    assert "world size 4" in out and "world size 2, 32 sequences per step" in out, out
    assert f"resumed from {tmp_path / 'elastic' / 'global_step4'} at step 4" in out + err
    expected, got = _losses(plain.stdout), _losses(out)
    assert sorted(got) == sorted(expected) == [1, *range(2, STEPS + 1, 2)], (expected, got)
    for step in expected:
        # the losses are printed to 4 decimals: values a hair apart (W=2 and W=4 sum in other orders) can round
        # one unit apart in the last digit; the parameters below are the fine comparison
        assert got[step] == pytest.approx(expected[step], abs=1.01e-4), (step, expected, got)
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "plain"))
    b = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "elastic"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
