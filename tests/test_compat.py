"""A DeepSpeed-style training script on zengine: with its import lines changed, and unchanged through
``zengine --deepspeed_compat`` / ``python -m zengine.compat`` (zengine/compat.py)."""

import json
import os
import subprocess
import sys

import pytest

import zengine
from zengine import compat

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))
EXAMPLE = os.path.join(PACKAGE_ROOT, "examples", "deepspeed_style", "train.py")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PACKAGE_ROOT, env.get("PYTHONPATH")] if p)
    env.pop("OMP_NUM_THREADS", None)
    return env


def _launch(cwd, *argv, timeout=240):
    from harness import free_port

    return subprocess.run(
        [sys.executable, "-m", "zengine.launcher.runner", "--master_port", str(free_port()), *argv],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _imports_changed(source: str) -> str:
    """What a user does by hand: only the import lines change."""
    return (
        source.replace("import deepspeed.comm as dist", "import zengine.comm as dist")
        .replace("import deepspeed\n", "import zengine as deepspeed\n")
        .replace("from deepspeed.", "from zengine.")
    )


def test_deepspeed_style_loop_runs_changed_and_unchanged_with_the_same_result(tmp_path):
    source = open(EXAMPLE).read()
    changed = tmp_path / "train_zengine.py"
    changed.write_text(_imports_changed(source))
    assert "deepspeed" not in [
        line.split()[1] for line in changed.read_text().splitlines() if line.startswith("import ")
    ]
    a, b = tmp_path / "changed", tmp_path / "unchanged"
    run = _launch(tmp_path, "--num_procs", "2", str(changed), "--out", str(a))
    assert run.returncode == 0, run.stderr[-3000:]
    run = _launch(tmp_path, "--deepspeed_compat", "--num_procs", "2", EXAMPLE, "--out", str(b))
    assert run.returncode == 0, run.stderr[-3000:]
    ra, rb = (
        json.loads((a / "result.json").read_text()),
        json.loads((b / "result.json").read_text()),
    )
    assert ra == rb  # the same training, bit for bit
    assert ra["world"] == 2 and ra["global_steps"] == 6
    assert ra["losses"][-1] < ra["losses"][0]  # it trains
    # the csv monitor wrote the loss of every optimizer step (6 of them), at the reports
    rows = (a / "csv" / "ds_style" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert len(rows) == 1 + 6, rows
    # the checkpoint and the zero_to_fp32.py script DeepSpeed users expect beside it
    script = a / "ckpt" / "zero_to_fp32.py"
    out = subprocess.run(
        [sys.executable, str(script), str(a / "ckpt"), str(tmp_path / "fp32")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    import torch

    state = torch.load(tmp_path / "fp32" / "pytorch_model.bin")
    for name, values in ra["params"].items():
        assert torch.equal(state[name], torch.tensor(values)), name


def test_compat_aliases_and_refusals_in_process():
    code = (
        "import zengine.compat as c; c.install();"
        "import deepspeed, deepspeed.comm as dist;"
        "from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam;"
        "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus;"
        "from deepspeed.accelerator import get_accelerator;"
        "from deepspeed.utils import RepeatingLoader, logger;"
        # DeepSpeed's CIFAR-10 example imports the MoE helpers with its MoE switch off
        "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split;"
        "import torch; p = torch.nn.Parameter(torch.ones(2)); groups = split({'params': [p], 'lr': 1});"
        "print(deepspeed.__name__, dist.get_world_size(), get_accelerator().device_name(), len(groups),"
        "      groups[0]['params'][0] is p);"
        "from deepspeed.moe.layer import MoE\n"
        "try:\n    MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2)\n"
        "except NotImplementedError as e:\n    print('refused:', e)\n"
        "import deepspeed.pipe"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split()[:5] == ["zengine", "1", "cpu", "1", "True"], out.stderr
    assert (
        "refused: deepspeed.moe.layer.MoE: zengine does not implement mixture-of-experts"
        in out.stdout
    )
    assert "pipeline parallelism is not part of zengine" in out.stderr


def test_python_m_zengine_compat_runs_a_script(tmp_path):
    (tmp_path / "s.py").write_text(
        "import sys, deepspeed\nprint(deepspeed.__name__, sys.argv[1:])\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "zengine.compat", str(tmp_path / "s.py"), "x"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["zengine", "['x']"]


@pytest.mark.parametrize("name", sorted(compat.ALIASES))
def test_every_alias_target_imports(name):
    __import__(compat.ALIASES[name])
