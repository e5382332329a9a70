"""Shared by the Lightning Trainer tests: the user's script (a LightningModule, a CPU subclass of
Lightning's DeepSpeedStrategy), started as ``python train.py`` with ``ZENGINE_DEEPSPEED_COMPAT=1``
in the environment, and the plain-torch reference it is compared with.

Lightning's strategy accepts only CUDA; the subclass skips exactly that: the accelerator check of
``setup_environment`` and the device-index check of ``setup_distributed`` (CPU devices have no
index). Lightning's launcher starts the second rank itself; it gets the compatibility mode from the
``.pth`` hook. The model is built in ``configure_model`` (Lightning's way for stage 3: inside the
strategy's ``deepspeed.zero.Init``); its optimizer is AdamW with a StepLR schedule stepped every
step, which Lightning steps on the optimizer zengine keeps and restores from the client state.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import torch

LR, MICRO, WORLD = 1e-2, 2, 2
GAMMA = 0.5  # StepLR at every step: a schedule that does not reach the engine, or is lost, shows

PRELUDE = '''
import os
import sys

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy
from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy without its CUDA-only checks (this host has no GPU)."""

    def setup_environment(self):
        DDPStrategy.setup_environment(self)  # (skips: the accelerator must be CUDA)

    def setup_distributed(self):
        reset_seed()  # (skips: device indices must equal local ranks)
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Net(pl.LightningModule):
    def __init__(self, seed, rows={n}):
        super().__init__()
        self.seed, self.rows = seed, rows

    def configure_model(self):  # under the strategy's zero.Init: built sharded at stage 3
        torch.manual_seed(self.seed)
        layers = [torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)]
        self.net = torch.nn.Sequential(*layers)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr={lr}, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma={gamma})
        return {{"optimizer": opt, "lr_scheduler": {{"scheduler": schedule, "interval": "step"}}}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        n = self.rows
        x, y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        data = torch.utils.data.TensorDataset(x, y)
        return torch.utils.data.DataLoader(data, batch_size={micro})


def trainer(stage, steps, accumulate_grad_batches=1, **options):
    strategy = CPUDeepSpeedStrategy(stage=stage, **options)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                      accumulate_grad_batches=accumulate_grad_batches, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


'''.format(lr=LR, gamma=GAMMA, n=MICRO * WORLD, micro=MICRO)


def run_script(tmp_path: Path, body: str) -> None:
    """Write PRELUDE + ``body`` as train.py and run it as a user would (``out`` is ``tmp_path``)."""
    import zengine

    (tmp_path / "train.py").write_text(PRELUDE + "\nout = sys.argv[1]\n" + body)
    root = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))
    path = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p)
    env = dict(os.environ, ZENGINE_DEEPSPEED_COMPAT="1", OMP_NUM_THREADS="1", PYTHONPATH=path)
    env.pop("LOCAL_RANK", None)  # Lightning's launcher starts the other rank from a plain process
    run = subprocess.run(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


def named(model: torch.nn.Module) -> dict:
    """The reference's weights under the LightningModule's names."""
    return {f"net.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def plain(rows: int, steps: int) -> Iterator[tuple]:
    """Plain torch in one process, each step on all ``rows`` (the global batch): yields the step
    number, the model after it, and the data. An epoch is one global batch (each rank's
    DistributedSampler gives it its share of the rows, in a shuffled order that a mean loss does
    not see), so every step is on every row, however a resumed fit counts epochs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)
    for step in range(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        yield step + 1, model, x, y


def check_converted(tmp_path: Path, name: str, steps: int, reference: dict) -> None:
    """``name``.pt (Lightning's converter's output) has ``global_step`` ``steps`` and the
    reference's weights (<1e-6: the ranks' mean of half-batch gradients differs from the
    one-process gradient by rounding only)."""
    converted = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    assert converted["global_step"] == steps
    weights = converted["state_dict"]
    assert set(weights) == set(reference)
    worst = max((weights[k] - v).abs().max().item() for k, v in reference.items())
    assert worst < 1e-6, (name, worst)
