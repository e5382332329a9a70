"""zengine.initialize: the DeepSpeed-style entry point, and bad input refused before any work."""

import argparse

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from harness import spawn
from zengine.config import ConfigError


def test_bad_config_is_refused_before_any_work(tmp_path):
    model = nn.Linear(3, 3)
    before = model.weight.detach().clone()
    bad = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stgae": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with pytest.raises(ConfigError, match=r"zero_optimization\.stgae.*stage"):
        zengine.initialize(model=model, config=bad)
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        zengine.initialize(model=model, config=str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text(
        '{"train_batch_size": 8,\n  "fp16": {"enabled": true}]}'
    )  # a bracket that closes nothing
    with pytest.raises(ConfigError, match="line 2"):
        zengine.initialize(model=model, config=str(broken))
    assert not dist.is_initialized(), "the process group was started before the config was checked"
    assert torch.equal(model.weight, before)


def test_config_given_twice_is_refused():
    args = argparse.Namespace(deepspeed_config="configs/zero1.json", local_rank=-1)
    with pytest.raises(ValueError, match="both in the call and in args"):
        zengine.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 1}, args=args)


def deepspeed_style_loop(config_path):
    import zengine as deepspeed  # a DeepSpeed training loop, unchanged

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(
        ["--deepspeed", "--deepspeed_config", config_path, "--local_rank", "0"]
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=data
    )
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.global_steps == len(loader) == 64 // (8 * dist.get_world_size())
    assert engine.global_samples == engine.global_steps * engine.train_batch_size()
    assert scheduler is engine.lr_scheduler and optimizer is engine.optimizer
    assert engine.zero_optimization_stage() == 2 and engine.world_size == dist.get_world_size()
    return losses, engine.get_lr()


def test_deepspeed_training_loop_runs_unchanged():
    results = spawn(deepspeed_style_loop, 2, "configs/zero2.json")
    (losses, lr), _ = results
    assert len(losses) == 4 and lr[0] > 0


def test_parameter_offload_without_optimizer_offload_is_refused_by_name():
    model = nn.Linear(3, 3)
    cases = [
        (
            {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
            "offload to 'nvme' needs the optimizer on the host too",
        ),
        (
            {"offload_param": {"device": "cpu"}},
            "offload to 'cpu' needs the optimizer on the host too",
        ),
    ]
    for zero, message in cases:
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {}},
            "zero_optimization": {"stage": 3, **zero},
        }
        with pytest.raises(ConfigError, match=message):
            zengine.initialize(model=model, config=cfg)
    assert not dist.is_initialized()


def _frozen_model():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net.requires_grad_(False)
    return net


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: nn.ReLU(), "has no parameters"),
        (_frozen_model, "none of the model's 4 parameters requires grad"),
    ],
)
def test_model_with_nothing_to_train_is_refused_before_any_work(make, match):
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match=match):
        zengine.initialize(model=make(), config=config)
    assert not dist.is_initialized(), "the process group was started before the model was checked"


def _frozen_param_groups():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[0].requires_grad_(False)
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match="hold no parameter that requires grad"):
        zengine.initialize(model=net, config=config, model_parameters=net[0].parameters())


def test_model_parameters_all_frozen_are_refused():
    spawn(_frozen_param_groups, 1)
