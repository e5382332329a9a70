"""Hugging Face's Trainer with the DeepSpeed configs transformers documents, as users copy them
(issue 46): ``tests/fixtures/hf/ds_config_zero2.json`` (ZeRO-2, optimizer offloaded to the CPU) and
``ds_config_zero3.json`` (ZeRO-3, optimizer and parameters offloaded to the CPU), read unchanged
(their sources: tests/fixtures/hf/README.md). Both carry "auto" for what the Trainer decides, the
config's own AdamW and DeepSpeed's WarmupLR schedule; ZeRO-3's model is loaded with
``from_pretrained`` after the arguments exist, so it is built inside ``zero.Init`` with the
"auto" values still unfilled; it trains whole, and with LoRA adapters (peft, when installed: the
base model frozen and sharded, the adapters added outside ``zero.Init`` and taken over by the
engine; ``save_model`` writes the adapter).

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
import torch

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
HAVE_PEFT = importlib.util.find_spec("peft") is not None
# run -> (config file, the model it trains): ZeRO-2 GPT-2 (its head tied); ZeRO-3 Llama (untied),
# whole and with LoRA adapters (peft) on its attention, the base frozen and sharded
RUNS = {
    "zero2": ("ds_config_zero2.json", "gpt2"),
    "zero3": ("ds_config_zero3.json", "llama"),
    **({"zero3_lora": ("ds_config_zero3.json", "lora")} if HAVE_PEFT else {}),
}


def warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR as the Trainer fills the documented configs (``warmup_min_lr`` 0,
    ``warmup_num_steps`` 1, which it stretches to 2): the first step runs at ``warmup_min_lr``
    (iteration -1), then ``log(i + 1) / log(2)`` of the learning rate at iteration i, capped at
    1: 0, 0, then the Trainer's rate from the third step on."""
    return 0.0 if step == 0 else min(1.0, math.log(step) / math.log(2))


def _model(kind: str, out: str):
    """GPT-2 built from its config; Llama loaded from the copy _reference saved (at ZeRO-3, after the
    Trainer's arguments exist: transformers builds it inside zero.Init), with LoRA adapters for
    "lora" (their random half drawn from one seed on every side)."""
    import transformers

    if kind == "gpt2":
        return build_model(kind)
    model = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "llama_init"))
    if kind == "lora":
        import peft

        torch.manual_seed(1)
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
        )
        model = peft.get_peft_model(model, lora)
    return model


def _reference(out: str) -> dict:
    """Each model trained by the Trainer in this one process, without DeepSpeed, on the global
    batch: its losses and its weights (a PEFT model's: the adapter save_model writes)."""
    build_model("llama").save_pretrained(os.path.join(out, "llama_init"))
    refs = {}
    for kind in {kind for _, kind in RUNS.values()}:
        path = os.path.join(out, "ref_" + kind)
        t = in_order_trainer(model=_model(kind, out), train_dataset=Tokens(), lr_lambda=warmup_lr,
                             args=training_args(path, MICRO * 2))  # fmt: skip
        t.train()
        t.save_model(os.path.join(path, "final"))
        weights = {n: p.detach().tolist() for n, p in t.model.named_parameters()}
        refs[kind] = (
            logged_losses(t),
            saved_weights(os.path.join(path, "final")) if kind == "lora" else weights,
        )
    return refs


def _zengine(out: str) -> dict:
    zengine_ranks()

    res = {}
    for name, (file, kind) in RUNS.items():
        config = str(FIXTURES / file)  # the path, as --deepspeed ds_config_zero3.json passes it
        for run, resume in (
            (name, None),
            (name + ":resumed", os.path.join(out, name, "checkpoint-2")),
        ):
            fresh_accelerate_state()
            args = training_args(os.path.join(out, run.replace(":", "_")), MICRO, config,
                                 save_strategy="steps", save_steps=2)  # fmt: skip
            t = in_order_trainer(model=_model(kind, out), args=args, train_dataset=Tokens())
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
    for name, (file, kind) in RUNS.items():
        documented = json.loads((FIXTURES / file).read_text())["zero_optimization"]
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
