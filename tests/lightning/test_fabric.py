"""Lightning Fabric's ``DeepSpeedStrategy`` on zengine (issue 46): the user's script started as
``python train.py`` with ``ZENGINE_DEEPSPEED_COMPAT=1`` in the environment (Fabric's launcher starts
the second rank, which gets the compatibility mode from the ``.pth`` hook). At ZeRO stages 2 and 3
on 2 gloo ranks: 4 steps uninterrupted; then 2 steps, ``fabric.save``, a model and optimizer built
anew from other weights, ``fabric.load`` of model and optimizer, 2 more steps. The losses after the
load must equal the uninterrupted run's (the optimizer state is restored: without Adam's moments the
fourth step differs), and the final weights (``deepspeed.utils.zero_to_fp32`` on a last save) must
equal both the uninterrupted run's and plain torch in one process on the global batch.

Fabric's strategy accepts only CUDA; the script's subclass skips exactly that: the accelerator check
of ``setup_environment`` and the device-index check of ``_setup_distributed`` (CPU devices have no
index). Both stages run in the same two processes: importing Lightning takes most of the time.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning_fabric") is None,
    reason="the test extra installs pytorch-lightning (lightning_fabric)",
)

LR, MICRO, WORLD, STEPS = 1e-2, 2, 2, 4

SCRIPT = '''
import os
import sys

import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning_fabric.utilities.seed import reset_seed


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy without its CUDA-only checks (this host has no GPU)."""

    def setup_environment(self):
        DDPStrategy.setup_environment(self)  # (skips: the accelerator must be CUDA)

    def _setup_distributed(self):
        reset_seed()  # (skips: device indices must equal local ranks)
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True


def build(fabric, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr={lr}, weight_decay=0.0)
    return fabric.setup(model, opt)


def train(fabric, model, opt, steps):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn({rows}, 4, generator=g), torch.randn({rows}, 2, generator=g)
    losses = []
    for step in steps:  # rank r: its part of the step's global batch
        first = (step * {world} + fabric.global_rank) * {micro}
        rows = slice(first, first + {micro})
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        fabric.backward(loss, model=model)  # (several engines live in this process)
        opt.step()
        losses.append(loss.item())
    return losses


def final_weights(fabric, model, opt, path):
    fabric.save(path, {{"model": model, "optimizer": opt}})
    if fabric.global_rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(path)


out = sys.argv[1]
results = {{}}
for stage in (2, 3):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=stage))
    fabric.launch()
    model, opt = build(fabric, 0)
    whole = train(fabric, model, opt, range({steps}))
    whole_weights = final_weights(fabric, model, opt, os.path.join(out, f"s{{stage}}_whole"))
    model, opt = build(fabric, 0)
    first = train(fabric, model, opt, range(2))
    fabric.save(os.path.join(out, f"s{{stage}}_2"), {{"model": model, "optimizer": opt, "step": 2}})
    model, opt = build(fabric, 5)  # other weights and a fresh optimizer: the load restores both
    state = {{"model": model, "optimizer": opt, "step": 0}}
    fabric.load(os.path.join(out, f"s{{stage}}_2"), state)
    after = train(fabric, model, opt, range(state["step"], {steps}))
    weights = final_weights(fabric, model, opt, os.path.join(out, f"s{{stage}}_resumed"))
    results[stage] = {{"whole": whole, "resumed": first + after, "step": state["step"],
                      "whole_weights": whole_weights, "weights": weights}}
if fabric.global_rank == 0:
    torch.save(results, os.path.join(out, "results.pt"))
'''.format(lr=LR, rows=STEPS * MICRO * WORLD, world=WORLD, micro=MICRO, steps=STEPS)


def _reference() -> dict:
    """Plain torch in one process, each step on the global batch (rows [4s, 4s+4) at step s)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    n = STEPS * MICRO * WORLD
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
    for step in range(STEPS):
        rows = slice(step * MICRO * WORLD, (step + 1) * MICRO * WORLD)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_fabric_save_load_restores_model_and_optimizer_at_stages_2_and_3(tmp_path):
    import zengine

    (tmp_path / "train.py").write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))
    env = dict(
        os.environ,
        ZENGINE_DEEPSPEED_COMPAT="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p),
    )
    env.pop("LOCAL_RANK", None)  # Fabric's launcher starts the other rank only from a plain process
    run = subprocess.run(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    reference = _reference()
    for stage in (2, 3):
        r = results[stage]
        assert r["step"] == 2  # the client state came back too
        gap = max(abs(a - b) for a, b in zip(r["whole"], r["resumed"]))
        assert gap < 1e-6, (stage, r["whole"], r["resumed"])
        for name, weights in (("resumed", r["weights"]), ("uninterrupted", r["whole_weights"])):
            assert set(weights) == set(reference), name
            worst = max((weights[k] - v).abs().max().item() for k, v in reference.items())
            assert worst < 1e-6, (stage, name, worst)
