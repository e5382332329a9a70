"""An engine built without an optimizer (issue 46): ``deepspeed.initialize(model=ref, config=cfg)`` with no
``optimizer=`` and no "optimizer" section, as TRL builds its reference model, Lightning its
``validate``/``test``/``predict`` engine (``optimizer=None, model_parameters=[]``) and Fabric its
``setup_module``. It runs forward like the plain module at every stage (stage 3 gathering), saves and loads
the model, and refuses ``backward``/``step`` by name. 2 gloo ranks; the reference is the plain module.
"""

import os

import pytest
import torch
from torch import nn

import zengine
from harness import spawn
from zengine.checkpoint.errors import CheckpointMismatchError
from zengine.engine.build import NoOptimizerError


def _model(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return net.requires_grad_(not frozen)


def _config(stage: int, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": True,
            **zero,
        },
    }


def _forward_save_load(stage: int, out: str) -> dict:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1 + torch.distributed.get_rank()))
    plain = _model()
    expected = plain(x).detach()
    # Lightning's inference form; the model frozen, as TRL's create_reference_model leaves it
    engine, optimizer, _, scheduler = zengine.initialize(
        model=_model(frozen=stage == 3), config=_config(stage), optimizer=None, model_parameters=[]
    )
    res = {"returned": (optimizer, scheduler), "stage": engine.zero_optimization_stage()}
    engine.eval()
    with torch.no_grad():
        res["eval"] = (engine(x) - expected).abs().max().item()
    engine.train()
    loss = engine(x).sum()  # (grad enabled, train mode: still no training step follows)
    res["train"] = (loss - expected.sum()).abs().item()
    for what, call in (("backward", lambda: engine.backward(loss)), ("step", engine.step)):
        with pytest.raises(NoOptimizerError, match=rf"engine\.{what}\(\): .*without an optimizer"):
            call()
    with engine.summon_full_params():
        res["summoned"] = max(
            (p - q).abs().max().item()
            for p, q in zip(engine.module.parameters(), plain.parameters())
        )
    state = engine._zero3_consolidated_16bit_state_dict()
    if state is not None:
        res["consolidated"] = max(
            (state[k] - v).abs().max().item() for k, v in plain.state_dict().items()
        )
    engine.save_16bit_model(os.path.join(out, f"z{stage}"))
    engine.save_checkpoint(os.path.join(out, f"ckpt{stage}"))
    # a fresh engine without an optimizer (other initial values) loads it
    torch.manual_seed(7)
    fresh, *_ = zengine.initialize(
        model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), config=_config(stage)
    )
    fresh.load_checkpoint(os.path.join(out, f"ckpt{stage}"))
    with torch.no_grad():
        res["reloaded"] = (fresh(x) - expected).abs().max().item()
    # a training engine loads its model; asked for optimizer states it has none of, it says so by name
    trainer, *_ = zengine.initialize(
        model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
        config={**_config(stage), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    with pytest.raises(CheckpointMismatchError, match="load_optimizer_states=False"):
        trainer.load_checkpoint(os.path.join(out, f"ckpt{stage}"))
    trainer.load_checkpoint(os.path.join(out, f"ckpt{stage}"), load_optimizer_states=False)
    with torch.no_grad():
        res["into_trainer"] = (trainer(x) - expected).abs().max().item()
    # and the other way: a training checkpoint loads into the engine without an optimizer
    trainer.backward(trainer(x).sum())
    trainer.step()
    trainer.save_checkpoint(os.path.join(out, f"trained{stage}"))
    fresh.load_checkpoint(os.path.join(out, f"trained{stage}"))
    with torch.no_grad():
        res["trained_into_fresh"] = (fresh(x) - trainer(x)).abs().max().item()
    for e in (engine, fresh, trainer):
        e.destroy()
    return res


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_without_optimizer_runs_forward_saves_and_loads(stage, tmp_path):
    for rank, res in enumerate(spawn(_forward_save_load, 2, stage, str(tmp_path))):
        assert res["returned"] == (None, None) and res["stage"] == stage
        for key in ("eval", "train", "summoned", "reloaded", "into_trainer", "trained_into_fresh"):
            assert res[key] == 0.0, (rank, key, res[key])
        assert res.get("consolidated", 0.0) == 0.0 and ("consolidated" in res) == (rank == 0)
    saved = torch.load(tmp_path / f"z{stage}" / "pytorch_model.bin")
    assert all(torch.equal(saved[k], v) for k, v in _model().state_dict().items())


def _stage3_offload_param() -> float:
    # TRL's prepare_deepspeed drops offload_optimizer and keeps offload_param: parameter offload alone
    engine, *_ = zengine.initialize(
        model=_model(), config=_config(3, offload_param={"device": "cpu"})
    )
    x = torch.randn(3, 8)
    with torch.no_grad():
        return (engine(x) - _model()(x)).abs().max().item()


def test_parameter_offload_alone_serves_an_engine_without_optimizer():
    assert spawn(_stage3_offload_param, 2) == [0.0, 0.0]
