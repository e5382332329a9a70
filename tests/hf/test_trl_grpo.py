"""TRL's GRPOTrainer at ZeRO-3 (issue 46): the trainer that generates. Before each step it samples
completions through TRL's ``unwrap_model_for_generation``, which at ZeRO-3 either gathers every
parameter, takes the stage-3 hooks off the model (``optimizer.parameter_offload``'s hook lists and
``ds_external_parameters``), generates, and puts them back with ``_register_deepspeed_module``
(``ds3_gather_for_generation=True``, the default), or generates through the hooks, gathering module
by module at each new token (``False``; transformers syncs the ranks' generation lengths).

A tiny Llama with an untied ``lm_head``, saved locally and named by path (nothing downloaded; the
reference model, ``beta`` > 0, is loaded from the same path under ``zero.Init``), a reward function
defined here, 2 gloo ranks, Hugging Face's documented ZeRO-3 JSON. The reference run is the same
trainer on the same 2 ranks without DeepSpeed (accelerate's DDP over gloo): GRPO samples its
completions on each rank from the rank's own generator, so one process generating the global batch
would sample other completions; on the same ranks with the same seeds the samples, rewards, losses
and weights must come out the same.
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

VOCAB, STEPS, LR = 64, 3, 1e-2
# the reference all-reduces the same gradients that stage 3 reduce-scatters, in another order; Adam
# turns that into a few 1e-6 on parameters that moved ~1e-2
PARAM_TOL = 5e-5
LOSS_TOL = 2e-6
ZERO3_DOCUMENTED = documented_zero3_without_optimizer()


def _save_model(path: str) -> None:
    untied_llama(VOCAB).save_pretrained(path)


def _prompts():
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = [" ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB, (3 + i % 3,), generator=g))
            for i in range(16)]  # fmt: skip
    return datasets.Dataset.from_dict({"prompt": rows})


def even_tokens(completion_ids, **kwargs):
    """The reward: the share of even token ids in each completion (something the policy can learn)."""
    return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


def _grpo(model_path: str, out: str, ds: dict = None, gather: bool = True):
    import trl

    fields = dict(output_dir=out, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=6, max_steps=STEPS, logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=True, learning_rate=LR, weight_decay=0.0,
                  max_grad_norm=1.0, seed=0, disable_tqdm=True, bf16=False, beta=0.04,
                  shuffle_dataset=False, ds3_gather_for_generation=gather,
                  log_completions=False)  # fmt: skip
    if ds is not None:
        fields.update(deepspeed=ds, accelerator_config={"use_configured_state": True})
    return trl.GRPOTrainer(model=model_path, reward_funcs=even_tokens, args=trl.GRPOConfig(**fields),
                           train_dataset=_prompts(), processing_class=word_tokenizer(VOCAB))  # fmt: skip


def _log(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


def _fresh_accelerate_state():
    """A new accelerate state on the same process group (several trainers share one process here to
    keep the test short; a user's script makes one)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState(backend="gloo")


def _runs(out: str) -> dict:
    """On each rank: the trainer without DeepSpeed (DDP), then at ZeRO-3 gathering for generation
    and not."""
    import zengine.compat

    # before transformers and accelerate look for deepspeed (the run without it sets no DeepSpeed
    # config: its trainer does not use it)
    zengine.compat.install()
    from accelerate import PartialState

    model_path = os.path.join(out, "init")
    res = {}

    PartialState(backend="gloo")
    t = _grpo(model_path, os.path.join(out, "ddp"))
    t.train()
    res["ddp"] = {
        "losses": _log(t, "loss"),
        "rewards": _log(t, "reward"),
        "params": {n: p.detach().tolist() for n, p in t.model.named_parameters()},
    }
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from zengine.zero.stage3.parameter_offload import ParameterOffload

    register = ParameterOffload._register_deepspeed_module
    for gather in (True, False):
        _fresh_accelerate_state()  # (now with DeepSpeed)
        t = _grpo(model_path, os.path.join(out, f"z3_{gather}"), ZERO3_DOCUMENTED, gather)
        calls = []  # TRL's add_hooks after each generation with the hooks off

        def counted(self, module, count=None):
            calls.append(module is t.model_wrapped.module)
            return register(self, module, count)

        ParameterOffload._register_deepspeed_module = counted
        try:
            t.train()
        finally:
            ParameterOffload._register_deepspeed_module = register
        state = t.accelerator.get_state_dict(t.model_wrapped)  # whole on rank 0
        head = t.model_wrapped.module.lm_head.weight
        offload = t.model_wrapped.optimizer.parameter_offload
        res[f"z3_{gather}"] = {
            "losses": _log(t, "loss"),
            "rewards": _log(t, "reward"),
            "params": {k: v.tolist() for k, v in state.items()} if state is not None else None,
            "engine": type(t.model_wrapped).__name__,
            "stage": t.model_wrapped.zero_optimization_stage(),
            "head_sharded": head.numel() == 0 and head.ds_numel == VOCAB * 32,
            "ref_engine": type(t.ref_model).__name__,
            "re_registered": calls,
            # a pre- and a post-forward hook per unit and the root's pair; a gradient hook per
            # trainable parameter: once each, whatever was taken off and put back
            "hooks": (
                (len(offload.forward_hooks), len(offload.backward_hooks)),
                (2 * len(offload.hooks.units) + 2, len(list(t.model_wrapped.module.parameters()))),
            ),
        }
    return res


def _max_diff(got: dict, ref: dict) -> float:
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return max((torch.tensor(got[n]) - torch.tensor(ref[n])).abs().max().item() for n in ref)


def test_grpo_trainer_generates_and_trains_at_stage3_like_ddp(tmp_path):
    spawn(_save_model, 1, os.path.join(str(tmp_path), "init"))
    got, other = spawn(_runs, 2, str(tmp_path))
    ref = got["ddp"]
    assert len(ref["losses"]) == STEPS
    for name in ("z3_True", "z3_False"):
        run = got[name]
        assert run["engine"] == "Engine" and run["stage"] == 3 and run["head_sharded"], name
        assert run["ref_engine"] == "Engine", (
            name
        )  # the reference model: an engine without optimizer
        assert run["rewards"] == pytest.approx(ref["rewards"], abs=1e-6), (name, run["rewards"])
        assert run["losses"] == pytest.approx(ref["losses"], abs=LOSS_TOL), (name, run["losses"])
        assert _max_diff(run["params"], ref["params"]) < PARAM_TOL, name
        assert other[name]["params"] is None
        hooks, once_each = run["hooks"]
        assert hooks == once_each, (name, run["hooks"])
    # gathering for generation took the hooks off and put them back once per generation (one a
    # step); generating through the hooks left them in place
    assert got["z3_True"]["re_registered"] == [True] * STEPS
    assert got["z3_False"]["re_registered"] == []
    # the two ways to generate sample the same completions from the same weights
    assert got["z3_True"]["losses"] == got["z3_False"]["losses"]
