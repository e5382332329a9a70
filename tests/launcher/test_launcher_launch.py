"""Real launches through torch.distributed.run: CPU processes on this machine."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import zengine

# The folder holding the `zengine` package the tests imported, so workers import the same one.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))

# Each rank records what it was started with in rank<RANK>.json beside the script.
RECORDING_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"]
    record = {"env": {name: os.environ.get(name) for name in names}, "argv": sys.argv,
              "main": __name__, "path0": sys.path[0]}
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "rank%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(record, f)
    """
)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launch(tmp_path, *argv, timeout=60):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PACKAGE_ROOT, env.get("PYTHONPATH")] if p)
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        [sys.executable, "-m", "zengine.launcher.runner", "--master_port", str(free_port()), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(tmp_path, world_size):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_two_processes_get_ranks_and_arguments(tmp_path):
    (tmp_path / "script.py").write_text(RECORDING_SCRIPT)
    result = launch(tmp_path, "--num_procs", "2", "script.py", "a", "--b", "c d")
    assert result.returncode == 0, result.stderr
    for rank, rec in enumerate(records(tmp_path, 2)):
        env = rec["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert rec["argv"] == ["script.py", f"--local_rank={rank}", "a", "--b", "c d"]
        assert rec["main"] == "__main__"
        assert rec["path0"] == str(tmp_path)  # the script's folder, as `python script.py` gives


def test_no_local_rank(tmp_path):
    (tmp_path / "script.py").write_text(RECORDING_SCRIPT)
    result = launch(tmp_path, "--num_gpus", "1", "--no_local_rank", "script.py", "x")
    assert result.returncode == 0, result.stderr
    (rec,) = records(tmp_path, 1)
    assert rec["argv"] == ["script.py", "x"]
    assert rec["env"]["LOCAL_RANK"] == "0" and rec["env"]["WORLD_SIZE"] == "1"


def test_failing_rank_fails_the_launch(tmp_path):
    (tmp_path / "script.py").write_text(
        "import os, sys\nif os.environ['RANK'] == '1':\n    raise SystemExit(3)\n"
    )
    result = launch(tmp_path, "--num_procs", "2", "script.py")
    assert result.returncode == 3, result.stderr
    assert "FAILED" in result.stderr


def test_restart_after_a_failure(tmp_path):
    (tmp_path / "script.py").write_text(
        RECORDING_SCRIPT
        + textwrap.dedent(
            """
            marker = os.path.join(here, "failed_once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("first attempt fails")
            """
        )
    )
    result = launch(tmp_path, "--num_procs", "1", "--max_restarts", "1", "script.py")
    assert result.returncode == 0, result.stderr
    (rec,) = records(tmp_path, 1)
    assert rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"


def test_error_is_reported_before_starting(tmp_path):
    result = launch(tmp_path, "--num_procs", "2", "missing.py")
    assert result.returncode == 2
    assert "training script 'missing.py' not found" in result.stderr
