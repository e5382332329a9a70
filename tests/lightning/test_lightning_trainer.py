"""PyTorch Lightning's ``Trainer(strategy=DeepSpeedStrategy(stage=...))`` on zengine (issue 46): the
user's script started as ``python train.py`` with ``ZENGINE_DEEPSPEED_COMPAT=1`` in the environment;
Lightning's launcher starts the second rank itself, which gets the compatibility mode from the
``.pth`` hook. At ZeRO stages 2 and 3 on 2 gloo ranks, with the model built in ``configure_model``
(Lightning's way for stage 3: inside the strategy's ``deepspeed.zero.Init``), the script fits 2
steps, saves (``trainer.save_checkpoint``), fits to step 4 from that checkpoint (``ckpt_path``) with
a model built from other weights, saves again, and converts both checkpoints with Lightning's
``convert_zero_checkpoint_to_fp32_state_dict``. The converted weights must equal plain torch in one
process on the global batch after 2 and 4 steps, with a StepLR schedule Lightning steps on the
engine's optimizer (a resume that lost Adam's moments, the schedule or the weights fails), and carry
Lightning's own state (``global_step``). Last, at stage 3, a fit from the converted file with
``DeepSpeedStrategy(load_full_weights=True)`` (Lightning loads it into the sharded model through
``deepspeed.zero.GatheredParameters(modifier_rank=0)``) takes a fifth step, with a new optimizer
state as Lightning warns, from the 4-step weights; and at stage 2 a fit with
``accumulate_grad_batches=2`` equals plain torch on both micro-batches of each step.

Lightning's strategy accepts only CUDA; the script's subclass skips exactly that: the accelerator
check of ``setup_environment`` and the device-index check of ``setup_distributed`` (CPU devices have
no index). Both stages run in the same two processes: importing Lightning takes most of the time.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="the test extra installs pytorch-lightning",
)

LR, MICRO, WORLD = 1e-2, 2, 2
GAMMA = 0.5  # StepLR at every step: Lightning steps it on the engine's optimizer and restores it

SCRIPT = '''
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


out = sys.argv[1]
for stage in (2, 3):
    first = trainer(stage, 2)
    first.fit(Net(seed=0))
    first.save_checkpoint(os.path.join(out, f"s{{stage}}_2"))
    resumed = trainer(stage, 4)
    resumed.fit(Net(seed=5), ckpt_path=os.path.join(out, f"s{{stage}}_2"))  # other weights: loaded
    resumed.save_checkpoint(os.path.join(out, f"s{{stage}}_4"))
    if resumed.is_global_zero:
        for steps in (2, 4):
            name = os.path.join(out, f"s{{stage}}_{{steps}}")
            convert_zero_checkpoint_to_fp32_state_dict(name, name + ".pt")
    resumed.strategy.barrier()
# stage 3 from the converted single file (load_full_weights: the weights, not the optimizer state)
full = trainer(3, 5, load_full_weights=True)
full.fit(Net(seed=5), ckpt_path=os.path.join(out, "s3_4.pt"))
full.save_checkpoint(os.path.join(out, "s3_5"))
if full.is_global_zero:
    name = os.path.join(out, "s3_5")
    convert_zero_checkpoint_to_fp32_state_dict(name, name + ".pt")
# stage 2, accumulate_grad_batches=2 (the config's gradient_accumulation_steps): 2 micro-batches
accumulating = trainer(2, 2, accumulate_grad_batches=2)
accumulating.fit(Net(seed=0, rows=2 * {n}))
accumulating.save_checkpoint(os.path.join(out, "s2_acc"))
if accumulating.is_global_zero:
    name = os.path.join(out, "s2_acc")
    convert_zero_checkpoint_to_fp32_state_dict(name, name + ".pt")
'''.format(lr=LR, gamma=GAMMA, n=MICRO * WORLD, micro=MICRO)


def _named(model: torch.nn.Module) -> dict:
    return {f"net.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def _plain(rows: int, steps: int):
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


def _reference() -> dict:
    """The weights after 2 and 4 steps; after a fifth with a new optimizer (a resume from one file
    with load_full_weights: a new AdamW at its initial lr, the restored schedule acts from its next
    step); after 2 steps of 2 micro-batches each (accumulate_grad_batches=2: twice the rows)."""
    after = {}
    for step, model, x, y in _plain(MICRO * WORLD, 4):
        after[step] = _named(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    after["full"] = _named(model)
    for _, model, _, _ in _plain(2 * MICRO * WORLD, 2):
        after["acc"] = _named(model)
    return after


def test_trainer_fit_save_resume_convert_at_stages_2_and_3(tmp_path):
    import zengine

    (tmp_path / "train.py").write_text(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))
    env = dict(
        os.environ,
        ZENGINE_DEEPSPEED_COMPAT="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p),
    )
    env.pop(
        "LOCAL_RANK", None
    )  # Lightning's launcher starts the other rank only from a plain process
    run = subprocess.run(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    reference = _reference()
    cases = [("s2_2", 2, 2), ("s2_4", 4, 4), ("s3_2", 2, 2), ("s3_4", 4, 4), ("s3_5", 5, "full"),
             ("s2_acc", 2, "acc")]
    for name, steps, expected in cases:
        converted = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert converted["global_step"] == steps
        weights = converted["state_dict"]
        assert set(weights) == set(reference[expected])
        worst = max((weights[k] - v).abs().max().item() for k, v in reference[expected].items())
        assert worst < 1e-6, (name, worst)
