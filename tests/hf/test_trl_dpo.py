"""TRL's DPOTrainer at ZeRO-3 (issue 46): a policy and a reference model, a tiny Llama with an untied
``lm_head`` built from a config (nothing downloaded), 2 gloo ranks, against the same DPOTrainer run in one
process without DeepSpeed on the global batch.

Two things the run goes through: TRL's ``prepare_deepspeed`` builds the reference engine with
``deepspeed.initialize(model=ref, config=...)`` and no optimizer (an engine for forward only); and TRL's
fused loss reads ``lm_head.weight`` directly (inside an ``autograd.Function``, under
``GatheredParameters``, released again before its backward hands back the gradient), so the gradient
reaches a sharded parameter, which stage 3 gathers first (``stage3/hooks.gather_before_gradient``). The
config is Hugging Face's documented ZeRO-3 JSON with its "auto" values (the Trainer fills them from the
model: the persistence threshold 10 x hidden leaves the head sharded) and offload to the host.
CPU recipe as in test_trainer.py.
"""

import importlib.util
import os

import pytest
import torch

from harness import spawn
from hf_runs import documented_zero3_without_optimizer, untied_llama, word_tokenizer

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate", "trl")),
    reason="the test extra installs transformers, accelerate and trl",
)

VOCAB, MICRO, GAS, STEPS, LR = 64, 2, 2, 3, 1e-2
# Both sides sum the same gradients in another order (reduce-scatter over 2 ranks vs one process);
# Adam turns that into a few 1e-6 on parameters that moved ~1e-2 (measured 3.7e-6)
PARAM_TOL = 5e-5
LOSS_TOL = 2e-6
ZERO3_DOCUMENTED = documented_zero3_without_optimizer()


def _model():
    return untied_llama(VOCAB)


def _preferences():
    import datasets

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB, (n,), generator=g))

    rows = [(words(4), words(3 + i % 3), words(2 + i % 4)) for i in range(32)]
    return datasets.Dataset.from_dict(
        {k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))}
    )


def _dpo(out: str, batch: int, ds: dict = None):
    """TRL's DPOTrainer reading the data in order (the reference and the ranks see the same global batches),
    fp32, a policy and a separate reference model."""
    import trl

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    fields = dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=GAS,
                  max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, seed=0, disable_tqdm=True,
                  bf16=False, max_length=16)  # fmt: skip
    if ds is not None:
        fields.update(deepspeed=ds, accelerator_config={"use_configured_state": True})
    return InOrder(model=_model(), ref_model=_model(), args=trl.DPOConfig(**fields),
                   train_dataset=_preferences(), processing_class=word_tokenizer(VOCAB))  # fmt: skip


def _losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _reference(out: str):
    t = _dpo(os.path.join(out, "reference"), MICRO * 2)
    t.train()
    return _losses(t), {n: p.detach().tolist() for n, p in t.model.named_parameters()}


def _zengine(out: str):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    import zengine.compat

    zengine.compat.install()  # before transformers and accelerate look for deepspeed
    from accelerate import PartialState

    PartialState(backend="gloo")
    t = _dpo(os.path.join(out, "zengine"), MICRO, ZERO3_DOCUMENTED)
    t.train()
    head = t.model_wrapped.module.lm_head.weight
    state = t.accelerator.get_state_dict(t.model_wrapped)  # whole on rank 0
    return {
        "losses": _losses(t),
        "params": {k: v.tolist() for k, v in state.items()} if state is not None else None,
        "engines": (type(t.model_wrapped).__name__, type(t.ref_model).__name__),
        "ref_trains": t.ref_model.trains.has_optimizer,
        "head_sharded": head.numel() == 0 and head.ds_numel == VOCAB * 32,
        "stage": t.model_wrapped.zero_optimization_stage(),
    }


def test_dpo_trainer_at_stage3_with_untied_head_trains_like_one_process(tmp_path):
    ref_losses, ref_params = spawn(_reference, 1, str(tmp_path))[0]
    got, other = spawn(_zengine, 2, str(tmp_path))
    assert got["engines"] == ("Engine", "Engine") and got["stage"] == 3
    assert got["ref_trains"] is False  # the reference engine: built without an optimizer
    assert got["head_sharded"] and other["params"] is None
    assert len(got["losses"]) == STEPS
    assert got["losses"] == pytest.approx(ref_losses, abs=LOSS_TOL), (got["losses"], ref_losses)
    assert set(got["params"]) == set(ref_params)
    diff = max(
        (torch.tensor(got["params"][n]) - torch.tensor(p)).abs().max().item()
        for n, p in ref_params.items()
    )
    assert diff < PARAM_TOL, diff
