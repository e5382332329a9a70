"""Elastic restarts (`zengine --max_restarts N`): a rank killed with SIGKILL mid-run, the job restarts by
itself, resumes from the latest checkpoint (``auto_resume``) and ends with exactly the parameters of an
uninterrupted run. The job is the main job, examples/train_gpt.py, checkpointing every few steps."""
import os
import subprocess
import sys
import textwrap

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
    import zengine.engine
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
    return subprocess.run([sys.executable, "-m", "zengine.launcher.runner", "--master_port", str(free_port()),
                           "--num_procs", "2", *extra, script, "--deepspeed_config", config, "--steps", str(STEPS),
                           "--print_every", str(EVERY), "--save_dir", save_dir, "--save_every", str(EVERY)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("config", ["zero2.json", "zero3.json"])
def test_killed_rank_restarts_and_ends_like_an_uninterrupted_run(tmp_path, config):
    config = os.path.join(REPO, "configs", config)
    plain = _launch(tmp_path, os.path.join(REPO, "examples", "train_gpt.py"), config, str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    wrapper = tmp_path / "killing_train_gpt.py"
    wrapper.write_text(KILLING_WRAPPER)
    elastic = _launch(tmp_path, str(wrapper), config, str(tmp_path / "elastic"), "--max_restarts", "1")
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    assert "exitcode: -9" in elastic.stderr  # a rank really died, and the agent restarted the job
    assert f"resumed from {tmp_path / 'elastic' / 'global_step4'} at step 4" in elastic.stderr + elastic.stdout
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "plain"))
    b = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "elastic"))
    assert open(tmp_path / "elastic" / "latest").read().strip() == f"global_step{STEPS}"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the restarted run ended elsewhere"


def test_restarts_use_the_c10d_rendezvous():
    from zengine.launcher.runner import build_parser, plan_launch, torchrun_argv

    args = build_parser().parse_args(["--num_procs", "2", "--max_restarts", "2", "--master_port", "29999", "x.py"])
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
    job = [os.path.join(REPO, "examples", "train_gpt.py"), "--deepspeed_config",
           os.path.join(REPO, "configs", "zero2.json"), "--steps", "4", "--print_every", "4"]
    launcher = [sys.executable, "-m", "zengine.launcher.runner"]
    one = subprocess.run([*launcher, "--master_port", str(free_port()), "--num_procs", "4", *job,
                          "--save_dir", str(tmp_path / "one")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(free_port())
    nodes = [subprocess.Popen([*launcher, "--num_nodes", "2", "--node_rank", str(i), "--num_procs", "2",
                               "--master_addr", "127.0.0.1", "--master_port", port, *job,
                               "--save_dir", str(tmp_path / "two")], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), [o[1][-2000:] for o in outs]
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "one"))
    b = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "two"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
