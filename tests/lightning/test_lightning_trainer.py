"""PyTorch Lightning's ``Trainer(strategy=DeepSpeedStrategy(stage=...))`` on zengine (issue 46), the
script run as a user would (``lightning_runs.py``). At ZeRO stages 2 and 3 on 2 gloo ranks it fits 2
steps, saves (``trainer.save_checkpoint``), fits to step 4 from that checkpoint (``ckpt_path``) with
a model built from other weights, saves again, and converts both checkpoints with Lightning's
``convert_zero_checkpoint_to_fp32_state_dict``. The converted weights must equal plain torch in one
process on the global batch after 2 and 4 steps (a resume that lost Adam's moments, the schedule or
the weights fails), and carry Lightning's own state (``global_step``). Then, at stage 3, a fit from
the converted file with ``DeepSpeedStrategy(load_full_weights=True)`` (Lightning loads it into the
sharded model through ``deepspeed.zero.GatheredParameters(modifier_rank=0)``) takes a fifth step,
with a new optimizer state as Lightning warns, from the 4-step weights; and at stage 2 a fit with
``accumulate_grad_batches=2`` equals plain torch on both micro-batches of each step. Everything runs
in the same two processes: importing Lightning takes most of the time.
"""

import importlib.util

import pytest
import torch

from lightning_runs import LR, MICRO, WORLD, check_converted, named, plain, run_script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="the test extra installs pytorch-lightning",
)

BODY = '''
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
'''.format(n=MICRO * WORLD)


def _reference() -> dict:
    """The weights after 2 and 4 steps; after a fifth with a new optimizer (a resume from one file
    with load_full_weights: a new AdamW at its initial lr, the restored schedule acts from its next
    step); after 2 steps of 2 micro-batches each (accumulate_grad_batches=2: twice the rows)."""
    after = {}
    for step, model, x, y in plain(MICRO * WORLD, 4):
        after[step] = named(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    after["full"] = named(model)
    for _, model, _, _ in plain(2 * MICRO * WORLD, 2):
        after["acc"] = named(model)
    return after


def test_trainer_fit_save_resume_convert_at_stages_2_and_3(tmp_path):
    run_script(tmp_path, BODY)
    reference = _reference()
    cases = [
        ("s2_2", 2, 2),
        ("s2_4", 4, 4),
        ("s3_2", 2, 2),
        ("s3_4", 4, 4),
        ("s3_5", 5, "full"),
        ("s2_acc", 2, "acc"),
    ]
    for name, steps, expected in cases:
        check_converted(tmp_path, name, steps, reference[expected])
