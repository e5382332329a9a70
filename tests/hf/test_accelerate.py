"""accelerate's ``DeepSpeedPlugin`` drives zengine as it drives DeepSpeed (issue 25 item 3): a user's own
loop (``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``, ``optimizer.step``) at stages 2 and 3 with
gradient accumulation 2 on 2 gloo ranks, against the same loop in plain torch on the global batch; then
``get_state_dict`` (the whole model on rank 0), ``save_state`` / ``load_state`` (training resumed from the
saved state repeats the same steps exactly).

On a CPU-only host accelerate keeps ``backend=None`` for DeepSpeed and counts one process: each rank builds
``PartialState(backend="gloo")`` first (the README's recipe). Both stages run in one process to keep the
suite short, with accelerate's state reset between them.
"""

import importlib.util
import os

import pytest
import torch

from harness import spawn
from hf_runs import tiny_causal_lm

# found, not imported: accelerate decides at import whether DeepSpeed is there (after zengine.compat.install())
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")),
    reason="the test extra installs transformers and accelerate",
)

VOCAB, SEQ, MICRO, GAS, STEPS, LR, CLIP = 64, 8, 2, 2, 4, 1e-2, 1.0
PARAM_TOL = (
    5e-5  # summation order (bucketed all-reduce vs one process) through Adam, as in test_trainer.py
)


def _model():
    torch.manual_seed(0)
    return tiny_causal_lm("gpt2", VOCAB, SEQ)


def _data() -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (STEPS * GAS * MICRO * 2, SEQ), generator=torch.Generator().manual_seed(3)
    )


def _reference(world: int) -> dict:
    """The loop in plain torch, one process: each micro-step's global batch, the loss divided by GAS."""
    model, data = _model(), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rows = MICRO * world
    for step in range(STEPS):
        for m in range(GAS):
            ids = data[(step * GAS + m) * rows : (step * GAS + m + 1) * rows]
            (model(input_ids=ids, labels=ids).loss / GAS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _train(acc, model, opt, loader, steps: int) -> None:
    """The loop as accelerate's examples write it."""
    done = 0
    for batch in loader:
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        done += acc.sync_gradients
        if done == steps:
            return


def _one_stage(stage: int, out: str) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(
        zero_stage=stage,
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        zero3_save_16bit_model=True,
    )
    acc = Accelerator(deepspeed_plugin=plugin)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = _data()
    # accelerate hands rank r every W-th micro-batch of this loader: the reference's global batches
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches = list(loader)
    _train(acc, model, opt, batches[: GAS * 2], 2)
    acc.save_state(os.path.join(out, f"state{stage}"))
    _train(acc, model, opt, batches[GAS * 2 :], 2)
    first = acc.get_state_dict(model)
    acc.load_state(os.path.join(out, f"state{stage}"))
    _train(acc, model, opt, batches[GAS * 2 :], 2)
    again = acc.get_state_dict(model)
    res = {"engine": type(model).__name__, "stage": model.config["zero_optimization"]["stage"]}
    if acc.is_main_process:
        res["params"] = {k: v.clone() for k, v in first.items()}
        res["resumed_diff"] = max((first[k] - again[k]).abs().max().item() for k in first)
    return res


def _accelerate_run(out: str) -> list:
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    import zengine.compat

    zengine.compat.install()  # before accelerate looks for deepspeed
    from accelerate import PartialState

    PartialState(backend="gloo")
    runs = [_one_stage(stage, out) for stage in (2, 3)]
    reference = _reference(torch.distributed.get_world_size())
    for run in runs:
        if "params" in run:
            params = run.pop("params")
            assert set(params) <= set(reference), sorted(set(params) - set(reference))
            run["diff"] = max((params[k] - reference[k]).abs().max().item() for k in params)
            run["keys"] = len(params)
    return runs


def test_accelerate_deepspeed_plugin_trains_saves_and_resumes(tmp_path):
    ranks = spawn(_accelerate_run, 2, str(tmp_path))
    for stage, run in zip((2, 3), ranks[0]):
        assert run["engine"] == "Engine" and run["stage"] == stage, run
        assert run["diff"] < PARAM_TOL, (
            stage,
            run,
        )  # the same training as plain torch on the global batch
        assert run["resumed_diff"] < 1e-7, (stage, run)  # load_state: the same steps again, exactly
        assert run["keys"] >= 2 * 12 + 4, (
            run
        )  # the whole model (every block's tensors), not a shard
    assert all("diff" not in run for run in ranks[1])  # the state dict is rank 0's
