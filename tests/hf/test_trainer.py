"""Hugging Face's Trainer and TRL's SFTTrainer drive zengine as they drive DeepSpeed (issue 25 item 3), with
the real libraries, tiny models built from a config (nothing downloaded) and 2 gloo ranks, against the same
trainer run in one process without DeepSpeed (the reference):

- GPT-2 at stage 2, the optimizer from the DeepSpeed config ("auto" values), gradient accumulation 2, a
  checkpoint every 2 steps, ``save_model``; ``resume_from_checkpoint`` continues to the same parameters;
- GPT-2 at stage 3 with the Trainer's own optimizer;
- Llama at stage 3 loaded with ``from_pretrained`` from a locally saved model (transformers enters
  ``zero.Init``: the parameters arrive partitioned), resumed from its stage-3 checkpoint, saved whole;
- TRL's ``SFTTrainer`` at stage 3 (when TRL is installed).

The CPU-only recipe the README gives: accelerate keeps ``backend=None`` for DeepSpeed on a host without a
GPU and counts one process, so each rank builds ``PartialState(backend="gloo")`` with
``ACCELERATE_USE_DEEPSPEED=true`` and the Trainer gets ``accelerator_config={"use_configured_state": True}``.
Several trainers share one process here (to keep the suite short), so accelerate's state is reset between
them; a user's script makes one.
"""

import importlib.util
import os

import pytest
import torch

from configs import SHARD_ALL, ds_config
from harness import spawn
from hf_runs import (
    HAVE_TRL,
    MICRO,
    PARAM_TOL,
    STEPS,
    VOCAB,
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

# found, not imported: accelerate decides at import whether DeepSpeed is there, so the ranks import it only
# after zengine.compat.install()
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")),
    reason="the test extra installs transformers and accelerate",
)


def _ds_config(stage: int, optimizer: bool) -> dict:
    """A DeepSpeed config as Trainer users write it: "auto" wherever the Trainer's arguments decide."""
    auto = {
        "type": "AdamW",
        "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto"),
    }
    return ds_config(
        stage,
        micro_batch="auto",
        gas="auto",
        clip="auto",
        lr=None,
        optimizer=auto if optimizer else None,
        train_batch_size="auto",
        zero={"stage3_gather_16bit_weights_on_model_save": True, **SHARD_ALL},
    )


def _sft_data():
    import datasets

    rows = [Tokens()[i]["input_ids"].tolist() for i in range(64)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def _tokenizer():
    """A word-level tokenizer over the model's vocabulary, built here (SFTTrainer wants one; nothing is
    downloaded)."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t1", eos_token="t1"
    )


def _reference(out: str) -> dict:
    """Each scenario's trainer in this one process, without DeepSpeed, on the global batch."""
    refs = {}
    llama_init = os.path.join(out, "llama_init")
    build_model("llama").save_pretrained(llama_init)
    for name, kind in (("gpt2", "gpt2"), ("llama", "llama")):
        t = in_order_trainer(
            model=build_model(kind),
            args=training_args(os.path.join(out, name), MICRO * 2),
            train_dataset=Tokens(),
        )
        t.train()
        refs[name] = (
            logged_losses(t),
            {n: p.detach().tolist() for n, p in t.model.named_parameters()},
        )
    if HAVE_TRL:
        t = in_order_trainer(
            "SFTTrainer",
            model=build_model("gpt2"),
            args=training_args(os.path.join(out, "sft"), MICRO * 2, sft=True),
            train_dataset=_sft_data(),
            processing_class=_tokenizer(),
        )
        t.train()
        refs["sft"] = (
            logged_losses(t),
            {n: p.detach().tolist() for n, p in t.model.named_parameters()},
        )
    return refs


def _zengine(out: str) -> dict:
    zengine_ranks()  # before transformers and accelerate look for deepspeed
    import transformers

    rank0 = torch.distributed.get_rank() == 0
    res = {}

    def finish(name, t):
        path = os.path.join(out, name, "final")
        t.save_model(path)
        res[name] = {
            "losses": logged_losses(t),
            "steps_run": steps_run(t),
            "saved": saved_weights(path) if rank0 else None,
            "stage": t.model_wrapped.config["zero_optimization"]["stage"],
            "engine": type(t.model_wrapped).__name__,
        }

    # GPT-2, stage 2, the optimizer from the config; a checkpoint at step 2, then resumed from it
    gpt2 = os.path.join(out, "gpt2")
    t = in_order_trainer(
        model=build_model("gpt2"),
        train_dataset=Tokens(),
        args=training_args(gpt2, MICRO, _ds_config(2, True), save_strategy="steps", save_steps=2),
    )
    t.train()
    finish("gpt2", t)
    fresh_accelerate_state()
    t = in_order_trainer(
        model=build_model("gpt2"),
        train_dataset=Tokens(),
        args=training_args(gpt2 + "_resumed", MICRO, _ds_config(2, True)),
    )
    t.train(resume_from_checkpoint=os.path.join(gpt2, "checkpoint-2"))
    finish("gpt2_resumed", t)
    # GPT-2, stage 3, the Trainer's own optimizer
    fresh_accelerate_state()
    t = in_order_trainer(
        model=build_model("gpt2"),
        train_dataset=Tokens(),
        args=training_args(os.path.join(out, "gpt2_z3"), MICRO, _ds_config(3, False)),
    )
    t.train()
    finish("gpt2_z3", t)
    # Llama, stage 3, from_pretrained under zero.Init (the arguments exist first, as in HF's examples)
    for name, resume in (
        ("llama", None),
        ("llama_resumed", os.path.join(out, "llama", "checkpoint-2")),
    ):
        fresh_accelerate_state()
        args = training_args(
            os.path.join(out, name), MICRO, _ds_config(3, True), save_strategy="steps", save_steps=2
        )
        model = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "llama_init"))
        if resume is None:
            weight = model.model.layers[0].mlp.up_proj.weight
            res["partitioned"] = (weight.numel(), getattr(weight, "ds_numel", None))
        t = in_order_trainer(model=model, args=args, train_dataset=Tokens())
        t.train(resume_from_checkpoint=resume)
        finish(name, t)
    if HAVE_TRL:
        fresh_accelerate_state()
        t = in_order_trainer(
            "SFTTrainer",
            model=build_model("gpt2"),
            train_dataset=_sft_data(),
            processing_class=_tokenizer(),
            args=training_args(os.path.join(out, "sft"), MICRO, _ds_config(3, True), sft=True),
        )
        t.train()
        finish("sft", t)
    return res


def test_trainer_and_sft_trainer_train_like_one_process(tmp_path):
    refs = spawn(_reference, 1, str(tmp_path))[0]
    got, other = spawn(_zengine, 2, str(tmp_path))
    assert other["gpt2"]["saved"] is None  # one writer
    expected = {
        "gpt2": ("gpt2", 2),
        "gpt2_resumed": ("gpt2", 2),
        "gpt2_z3": ("gpt2", 3),
        "llama": ("llama", 3),
        "llama_resumed": ("llama", 3),
    }
    if HAVE_TRL:
        expected["sft"] = ("sft", 3)
    for name, (ref_name, stage) in expected.items():
        run, (ref_losses, ref_params) = got[name], refs[ref_name]
        assert run["engine"] == "Engine" and run["stage"] == stage, (
            name,
            run["engine"],
            run["stage"],
        )
        # a resumed run ran only the steps after its checkpoint (the log it restored has the earlier ones)
        assert run["steps_run"] == (STEPS - 2 if "resumed" in name else STEPS), (
            name,
            run["steps_run"],
        )
        assert run["losses"] == pytest.approx(ref_losses, abs=2e-6), (
            name,
            run["losses"],
            ref_losses,
        )
        # save_model wrote every parameter; GPT-2's tied head may come as a copy of the embedding (below stage 3
        # accelerate clones the state dict, as with DeepSpeed), never as a different tensor
        saved = dict(run["saved"])
        if "lm_head.weight" not in ref_params and "lm_head.weight" in saved:
            assert saved.pop("lm_head.weight") == saved["transformer.wte.weight"], name
        assert set(saved) == set(ref_params), (name, sorted(set(saved) ^ set(ref_params)))
        assert max_diff(saved, ref_params) < PARAM_TOL, name
    assert (
        got["partitioned"][0] == 0 and got["partitioned"][1] == 64 * 32
    )  # arrived sharded, full size known
    # resuming reproduces the uninterrupted run
    assert max_diff(got["gpt2_resumed"]["saved"], got["gpt2"]["saved"]) < 1e-7
    assert max_diff(got["llama_resumed"]["saved"], got["llama"]["saved"]) < 1e-7
