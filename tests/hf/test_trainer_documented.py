"""Hugging Face's Trainer with the DeepSpeed configs transformers documents, as users copy them
(issue 46): ``tests/fixtures/hf/ds_config_zero2.json`` (ZeRO-2, optimizer offloaded to the CPU) and
``ds_config_zero3.json`` (ZeRO-3, optimizer and parameters offloaded to the CPU), read unchanged
(their sources: tests/fixtures/hf/README.md). Both carry "auto" for what the Trainer decides, the
config's own AdamW and DeepSpeed's WarmupLR schedule; ZeRO-3's model is loaded with
``from_pretrained`` after the arguments exist, so it is built inside ``zero.Init`` with the
"auto" values still unfilled.

On 2 gloo ranks each trains 4 steps (gradient accumulation 2) with a checkpoint at step 2, then a
second trainer resumes from that checkpoint. The reference is the same Trainer in one process
without DeepSpeed on the global batch, with torch's AdamW and the schedule the config's WarmupLR
gives once the Trainer has filled it (``warmup_num_steps`` 1, which DeepSpeed warms over 2 steps
on a log scale: the learning rate is 0 at the first two steps, then the Trainer's).
"""

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest

from harness import spawn
from hf_runs import (
    MICRO,
    PARAM_TOL,
    STEPS,
    Tokens,
    build_model,
    fresh_accelerate_state,
    in_order_trainer,
    logged_losses,
    max_diff,
    saved_weights,
    steps_run,
    training_args,
    zengine_ranks,
)

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")),
    reason="the test extra installs transformers and accelerate",
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
# config file -> the model it trains (ZeRO-2: GPT-2, its head tied; ZeRO-3: Llama, untied)
RUNS = {"ds_config_zero2.json": "gpt2", "ds_config_zero3.json": "llama"}


def warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR as the Trainer fills the documented configs (``warmup_min_lr`` 0,
    ``warmup_num_steps`` 1, which it stretches to 2): the first step runs at ``warmup_min_lr``
    (iteration -1), then ``log(i + 1) / log(2)`` of the learning rate at iteration i, capped at
    1: 0, 0, then the Trainer's rate from the third step on."""
    return 0.0 if step == 0 else min(1.0, math.log(step) / math.log(2))


def _reference(out: str) -> dict:
    """Each model trained by the Trainer in this one process, without DeepSpeed, on the global
    batch."""
    build_model("llama").save_pretrained(os.path.join(out, "llama_init"))
    refs = {}
    for kind in set(RUNS.values()):
        t = in_order_trainer(model=build_model(kind), train_dataset=Tokens(), lr_lambda=warmup_lr,
                             args=training_args(os.path.join(out, "ref_" + kind), MICRO * 2))  # fmt: skip
        t.train()
        refs[kind] = (
            logged_losses(t),
            {n: p.detach().tolist() for n, p in t.model.named_parameters()},
        )
    return refs


def _zengine(out: str) -> dict:
    zengine_ranks()
    import torch
    import transformers

    res = {}
    for name, kind in RUNS.items():
        config = str(FIXTURES / name)  # the path, as --deepspeed ds_config_zero3.json passes it
        for run, resume in (
            (name, None),
            (name + ":resumed", os.path.join(out, name, "checkpoint-2")),
        ):
            fresh_accelerate_state()
            args = training_args(os.path.join(out, run.replace(":", "_")), MICRO, config,
                                 save_strategy="steps", save_steps=2)  # fmt: skip
            if kind == "llama":  # after the arguments: transformers builds it inside zero.Init
                model = transformers.LlamaForCausalLM.from_pretrained(
                    os.path.join(out, "llama_init")
                )
            else:
                model = build_model(kind)
            t = in_order_trainer(model=model, args=args, train_dataset=Tokens())
            t.train(resume_from_checkpoint=resume)
            path = os.path.join(out, run.replace(":", "_"), "final")
            t.save_model(path)
            engine = t.model_wrapped
            res[run] = {
                "losses": logged_losses(t),
                "steps_run": steps_run(t),
                "saved": saved_weights(path) if torch.distributed.get_rank() == 0 else None,
                "engine": type(engine).__name__,
                "zero": {k: engine.config["zero_optimization"][k] for k in ("stage", "offload_optimizer", "offload_param") if k in engine.config["zero_optimization"]},
                "scheduler": type(engine.lr_scheduler).__name__,
            }  # fmt: skip
    return res


def test_documented_configs_train_and_resume_like_one_process(tmp_path):
    refs = spawn(_reference, 1, str(tmp_path))[0]
    got, other = spawn(_zengine, 2, str(tmp_path))
    for name, kind in RUNS.items():
        documented = json.loads((FIXTURES / name).read_text())["zero_optimization"]
        ref_losses, ref_params = refs[kind]
        full, resumed = got[name], got[name + ":resumed"]
        for run in (full, resumed):
            assert run["engine"] == "Engine" and run["scheduler"] == "WarmupLR", (name, run)
            assert run["zero"]["stage"] == documented["stage"]
            assert run["zero"]["offload_optimizer"]["device"] == "cpu", run["zero"]
            if "offload_param" in documented:
                assert run["zero"]["offload_param"]["device"] == "cpu", run["zero"]
        assert full["steps_run"] == STEPS and resumed["steps_run"] == STEPS - 2, name
        assert full["losses"] == pytest.approx(ref_losses, abs=2e-6), (
            name,
            full["losses"],
            ref_losses,
        )
        # the resumed trainer logs the steps after its checkpoint, as the uninterrupted one did
        assert resumed["losses"][-2:] == pytest.approx(full["losses"][-2:], abs=1e-7), name
        saved = dict(full["saved"])
        if "lm_head.weight" not in ref_params and "lm_head.weight" in saved:  # GPT-2's tied head
            assert saved.pop("lm_head.weight") == saved["transformer.wte.weight"], name
        assert max_diff(saved, ref_params) < PARAM_TOL, name
        assert max_diff(resumed["saved"], full["saved"]) < 1e-7, name
        assert other[name]["saved"] is None  # one writer
