"""The DeepSpeed engine members beyond training (engine/members.py), initialize's DeepSpeed signature,
and the optimizers scripts import from ``deepspeed.ops.adam``."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import adamw, ds_config
from harness import spawn


def _cfg(**extra):
    return ds_config(
        2, micro_batch=2, gas=2, clip=0.5, optimizer=adamw(1e-2, betas=[0.8, 0.9]), **extra
    )


def _members_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    # DeepSpeed's positional order: args first; keywords as scripts write them
    engine, opt, _, _ = zengine.initialize(
        None, model, None, model.parameters(), config=_cfg(), mpu=None, distributed_port=29555
    )
    out = {
        "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(),
        "clip": engine.gradient_clipping(),
        "spp": engine.steps_per_print(),
        "offload": engine.zero_offload_optimizer(),
        "mom": engine.get_mom(),
        "dp": (engine.get_data_parallel_world_size(), engine.dp_world_size, engine.mp_world_size),
    }
    x = torch.randn(2, 6)
    # a manual boundary after one micro-step (gas is 2): the step applies at once
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    out["steps_after_forced_boundary"] = engine.global_steps
    engine.set_gradient_accumulation_boundary(None)  # back to counting micro-steps
    engine.set_train_batch_size(4 * dist.get_world_size())  # micro 2 x gas 2 -> gas 2 stays
    engine.set_train_batch_size(2 * dist.get_world_size())  # gas 1: every step is a boundary
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    out["gas1"] = (engine.gradient_accumulation_steps(), engine.global_steps)
    with pytest.raises(ValueError, match="not a multiple"):
        engine.set_train_batch_size(3)
    # offload_states on the CPU: nothing to move, training goes on
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.offload_states()
    engine.reload_states()
    out["same_after_reload"] = all(
        torch.equal(a, p) for a, p in zip(before, engine.module.parameters())
    )
    engine.eval()
    out["eval"] = not engine.module.training
    engine.train()
    out["train"] = engine.module.training
    engine.destroy()
    return out


def test_engine_members_as_scripts_call_them():
    for out in spawn(_members_run, 2):
        assert (out["fp16"], out["bf16"], out["clip"], out["spp"], out["offload"]) == (
            False,
            False,
            0.5,
            10,
            False,
        )
        assert out["mom"] == [(0.8, 0.9)] and out["dp"] == (2, 2, 1)
        assert out["steps_after_forced_boundary"] == 1
        assert out["gas1"] == (1, 2)
        assert out["same_after_reload"] and out["eval"] and out["train"]


def test_initialize_refuses_model_parallelism_by_name():
    with pytest.raises(ValueError, match="mpu/mesh_param"):
        zengine.initialize(model=nn.Linear(2, 2), config=_cfg(), mpu=object())


def test_deepspeed_cpu_adam_takes_deepspeeds_order_and_refuses_amsgrad():
    from zengine.ops.adam import DeepSpeedCPUAdam

    p = nn.Parameter(torch.ones(4))
    opt = DeepSpeedCPUAdam([p], 0.1, False, (0.8, 0.9))  # lr, bias_correction, betas positionally
    g = opt.param_groups[0]
    assert (g["lr"], g["bias_correction"], g["betas"]) == (0.1, False, (0.8, 0.9))
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam([p], amsgrad=True)


def test_fused_adam_is_torch_adamw():
    from zengine.ops.adam import FusedAdam

    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(5)), None
    b = nn.Parameter(a.detach().clone())
    ours = FusedAdam([a], lr=0.1, weight_decay=0.1)  # adam_w_mode: decoupled decay
    ref = torch.optim.AdamW([b], lr=0.1, weight_decay=0.1)
    for _ in range(3):
        for p, o in ((a, ours), (b, ref)):
            o.zero_grad()
            (p**3).sum().backward()
            o.step()
    assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="bias_correction"):
        FusedAdam([a], bias_correction=False)


def test_zengine_ops_without_importing_it_first():
    import subprocess
    import sys

    code = "import zengine; print(zengine.ops.CPUAdam.__name__, zengine.comm.get_world_size())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["CPUAdam", "1"]
