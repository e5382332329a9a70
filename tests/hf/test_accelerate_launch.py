"""``accelerate launch --config_file cfg.yaml train.py`` with ``distributed_type: DEEPSPEED`` (issue 46):
the user's launch command and script unchanged but for ``ZENGINE_DEEPSPEED_COMPAT=1`` in the environment.
accelerate's own launcher process asks whether DeepSpeed is installed before any rank starts, so the
variable must reach it (the ``.pth`` hook, tests/test_compat_hook.py); its ranks then build zengine
engines. Both ways accelerate's config names the DeepSpeed config (inline keys, ``deepspeed_config_file``
with "auto" values), 2 ranks, against the same loop in plain torch on the global batch.

On a CPU-only host the script builds ``PartialState(backend="gloo")`` first (the README's recipe:
accelerate otherwise keeps no backend for DeepSpeed without a GPU and counts one process)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from harness import free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="the test extra installs accelerate"
)

STEPS, MICRO, WORLD, LR = 3, 2, 2, 1e-2

SCRIPT = '''
import sys
import torch
from accelerate import Accelerator
from accelerate.state import PartialState

PartialState(backend="gloo")  # CPU only (see the module docstring)
acc = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr={lr}, weight_decay=0.0)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn({n}, 4, generator=g), torch.randn({n}, 2, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size={micro})
model, opt, loader = acc.prepare(model, opt, loader)
for x, y in loader:
    acc.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
if acc.is_main_process:
    import deepspeed
    weights = {{k: v.tolist() for k, v in acc.unwrap_model(model).state_dict().items()}}
    clip = acc.state.deepspeed_plugin.deepspeed_config.get("gradient_clipping", 0.0)
    torch.save({{"engine": type(model).__name__, "deepspeed": deepspeed.__name__, "world": acc.num_processes,
                "clip": float(clip), "weights": weights}}, sys.argv[1])
'''.format(lr=LR, n=STEPS * MICRO * WORLD, micro=MICRO)

ACCELERATE = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
{deepspeed}
machine_rank: 0
main_training_function: main
{precision}num_machines: 1
num_processes: {world}
main_process_port: {port}
rdzv_backend: static
same_network: true
use_cpu: false
"""
INLINE = (
    "  gradient_accumulation_steps: 1\n  zero_stage: 2\n  offload_optimizer_device: none\n"
    "  offload_param_device: none\n  zero3_init_flag: false"
)
DS_FILE = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": True},
}  # (a bucket "auto" needs model.config)


def _reference(clip: float) -> dict:
    """The same loop in one process, each step on the global batch (accelerate gives rank r every W-th
    micro-batch: step s of 2 ranks is rows [s*4, s*4+4)), clipped as the config accelerate built says
    (its inline keys default gradient_clipping to 1.0)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    n = STEPS * MICRO * WORLD
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
    for s in range(STEPS):
        rows = slice(s * MICRO * WORLD, (s + 1) * MICRO * WORLD)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("way", ["inline", "deepspeed_config_file"])
def test_accelerate_launch_with_a_config_file_trains_on_zengine(tmp_path, way):
    import zengine

    if way == "inline":
        deepspeed = INLINE
    else:
        (tmp_path / "ds.json").write_text(json.dumps(DS_FILE))
        deepspeed = f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: false"
    cfg = tmp_path / "accelerate.yaml"
    # (with a DeepSpeed config file accelerate refuses its own precision key: the file says it)
    precision = "mixed_precision: 'no'\n" if way == "inline" else ""
    cfg.write_text(
        ACCELERATE.format(deepspeed=deepspeed, precision=precision, world=WORLD, port=free_port())
    )
    (tmp_path / "train.py").write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))
    env = dict(
        os.environ,
        ZENGINE_DEEPSPEED_COMPAT="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p),
    )
    out = tmp_path / "out.pt"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(cfg),
            str(tmp_path / "train.py"),
            str(out),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = torch.load(out)
    assert (result["engine"], result["deepspeed"], result["world"]) == ("Engine", "zengine", WORLD)
    reference = _reference(result["clip"])
    worst = max(
        (torch.tensor(result["weights"][k]) - v).abs().max().item() for k, v in reference.items()
    )
    assert worst < 1e-6, worst
