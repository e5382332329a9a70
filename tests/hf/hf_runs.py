"""What the Hugging Face tests share: the data, the tiny models (built from a config, nothing
downloaded), the trainer reading the data in order, its arguments (the CPU recipe: accelerate's
configured gloo state on each rank), and what a run leaves to compare (logged losses, saved
weights). Used by test_trainer.py, test_trainer_documented.py and the TRL tests (``word_tokenizer``)."""

import importlib.util
import json
import os
from pathlib import Path

import torch

VOCAB, SEQ, MICRO, GAS, STEPS, LR = 64, 16, 2, 2, 4, 1e-2
HAVE_TRL = importlib.util.find_spec("trl") is not None
# Both sides sum the same gradients in a different order (bucketed all-reduce of two ranks vs one process);
# Adam turns that into ~1e-5 on parameters that moved ~4e-2 (measured: 1.5e-5)
PARAM_TOL = 5e-5


class Tokens(torch.utils.data.Dataset):
    """Sequences a causal LM can learn a little of in 4 steps; the same on every rank."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def tiny_causal_lm(kind: str, vocab: int, positions: int, heads: int = 2, **extra):
    """A two-layer, 32-wide causal LM from a config (nothing downloaded): "llama" (lm_head its own
    parameter, grouped-query attention) or "gpt2" (lm_head tied to the token embedding, no dropout).
    ``heads``: GPT-2's attention heads; ``extra``: more config fields. Not seeded: the caller seeds."""
    import transformers

    if kind == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=positions,
                bos_token_id=0,
                eos_token_id=1,
                **extra,
            )
        )
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=32,
            n_layer=2,
            n_head=heads,
            n_positions=positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=1,
            **extra,
        )
    )


def build_model(kind: str):
    """The Trainer tests' model ("llama" or "gpt2"), seeded."""
    torch.manual_seed(0)
    return tiny_causal_lm(kind, VOCAB, SEQ)


def in_order_trainer(cls_name: str = "Trainer", lr_lambda=None, **kw):
    """The library's trainer reading the data in order (the reference and the ranks then see the same global
    batches: accelerate hands rank r every W-th micro-batch), counting the optimizer steps it runs itself.
    ``lr_lambda``: its schedule is this LambdaLR (a reference for a DeepSpeed config's scheduler)."""
    import transformers

    if cls_name == "SFTTrainer":
        import trl

        base = trl.SFTTrainer
    else:
        base = transformers.Trainer

    class InOrder(base):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def create_scheduler(self, num_training_steps, optimizer=None):
            if lr_lambda is None or self.is_deepspeed_enabled:
                return super().create_scheduler(num_training_steps, optimizer)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or self.optimizer, lr_lambda
            )
            return self.lr_scheduler

    class CountSteps(transformers.TrainerCallback):
        run = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.run += 1

    return InOrder(callbacks=[CountSteps()], **kw)


def steps_run(trainer) -> int:
    """Optimizer steps this trainer itself ran (a resumed one: only those after its checkpoint)."""
    return next(
        c.run for c in trainer.callback_handler.callbacks if type(c).__name__ == "CountSteps"
    )


def training_args(out: str, batch: int, ds: dict = None, sft: bool = False, **kw):
    import transformers

    fields = dict(
        output_dir=out,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=0,
        disable_tqdm=True,
    )
    if ds is not None:
        fields.update(deepspeed=ds, accelerator_config={"use_configured_state": True})
    fields.update(kw)
    if sft:
        import trl

        # TRL asks for bf16 by default; fp32 here, as the other trainers (bf16 is checked against torch elsewhere)
        return trl.SFTConfig(**fields, bf16=False, dataset_kwargs={"skip_prepare_dataset": True})
    return transformers.TrainingArguments(**fields)


def logged_losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def saved_weights(path: str) -> dict:
    """What ``save_model`` wrote to ``path``: the model, or a PEFT model's adapter."""
    from safetensors.torch import load_file

    name = (
        "adapter_model.safetensors"
        if os.path.exists(os.path.join(path, "adapter_config.json"))
        else "model.safetensors"
    )
    return {k: v.tolist() for k, v in load_file(os.path.join(path, name)).items()}


def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def max_diff(saved: dict, reference: dict) -> float:
    assert set(saved) <= set(reference), sorted(set(saved) - set(reference))
    return max(
        (torch.tensor(saved[n]) - torch.tensor(reference[n])).abs().max().item() for n in saved
    )


def zengine_ranks() -> None:
    """On each rank, before transformers and accelerate look for DeepSpeed: compat mode, and the CPU
    recipe (accelerate's state on the gloo group the harness started; the trainer's arguments ask
    for ``use_configured_state``)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    import zengine.compat

    zengine.compat.install()
    from accelerate import PartialState

    PartialState(backend="gloo")


def word_tokenizer(vocab: int):
    """A tokenizer of the words ``t0`` ... ``t<vocab-1>`` (one id each; t1 pads and ends, t2 is
    unknown), made here: nothing downloaded."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t1", eos_token="t1"
    )


def documented_zero3_without_optimizer() -> dict:
    """transformers' docs' ds_config_zero3.json (tests/fixtures/hf), less its optimizer and
    scheduler sections: the reference is the trainer's own AdamW and schedule."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "ds_config_zero3.json"
    return {
        k: v
        for k, v in json.loads(fixture.read_text()).items()
        if k not in ("optimizer", "scheduler")
    }


def untied_llama(vocab: int):
    """A tiny Llama whose lm_head is its own parameter (TRL's losses read it directly), seeded."""
    torch.manual_seed(0)
    return tiny_causal_lm("llama", vocab, 32, pad_token_id=1, tie_word_embeddings=False)
