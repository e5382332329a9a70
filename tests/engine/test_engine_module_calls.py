"""``engine.module`` calls that change what the engine owns are followed or refused, never half-applied
(issue 41 cases 2 and 11): ``engine.module.zero_grad()`` before each micro-step keeps only the last
micro-batch's gradient, as torch does (stages 0-3, 2 ranks, gradient_accumulation_steps 2 and 3,
``set_to_none`` True and False), and a ``zero_grad()`` right after the step changes nothing; a cast of
the module (``.to(bfloat16)``, ``.half()``, ``.double()``, ``.to_empty()``) raises
``EngineModuleError`` before any parameter changes, while calls that change nothing (``.float()``,
``.to("cpu")``, ``.cpu()``) run and training goes on equal to torch."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from zengine.engine.module_guard import EngineModuleError
from harness import spawn

MICRO, STEPS = 2, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches(gas: int, world: int = 2) -> list:
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(world * MICRO, 4, generator=g), torch.randn(world * MICRO, 1, generator=g))
            for _ in range(gas)
        ]
        for _ in range(STEPS)
    ]


def _config(stage: int, gas: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def _reference(gas: int, pattern: str, set_to_none: bool = True) -> torch.Tensor:
    """Plain torch on the global batch: ``each`` zeroes before every micro-step, else after the step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for micro_batches in _batches(gas):
        for x, y in micro_batches:
            if pattern == "each":
                model.zero_grad(set_to_none=set_to_none)
            (nn.functional.mse_loss(model(x), y) / gas).backward()
        opt.step()
        model.zero_grad()
    return _flat(model)


def _train(stage: int, gas: int, pattern: str, set_to_none: bool) -> torch.Tensor:
    engine, *_ = zengine.initialize(model=_model(), config=_config(stage, gas))
    rank = dist.get_rank()
    for micro_batches in _batches(gas):
        for x, y in micro_batches:
            if pattern == "each":
                engine.module.zero_grad(set_to_none=set_to_none)
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
        if pattern == "after":
            engine.module.zero_grad()  # the common pattern: harmless right after the boundary
    with engine.summon_full_params(writeback=False):
        out = _flat(engine.module)
    engine.destroy()
    return out.tolist()  # (tensors do not travel back through the harness's queue)


def _zero_grad_runs(stage: int) -> dict:
    runs = {
        (gas, "each", s): _train(stage, gas, "each", s) for gas in (2, 3) for s in (True, False)
    }
    runs[(2, "after", True)] = _train(stage, 2, "after", True)
    runs[(1, "after", True)] = _train(stage, 1, "after", True)
    return runs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_module_zero_grad_before_each_micro_step_keeps_the_last_as_torch(stage):
    for runs in spawn(_zero_grad_runs, 2, stage):
        for (gas, pattern, set_to_none), weights in runs.items():
            weights, expected = torch.tensor(weights), _reference(gas, pattern, set_to_none)
            assert (weights - expected).abs().max() < 1e-6, (stage, gas, pattern, set_to_none)
            if pattern == "each":  # the comparison can fail: accumulating all differs
                assert (weights - _reference(gas, "after")).abs().max() > 1e-3


def _submodule_zero_grad(stage: int) -> tuple:
    engine, *_ = zengine.initialize(model=_model(), config=_config(stage, 2))
    x, y = _batches(2, 1)[0][0]
    engine.module[0].zero_grad()  # nothing accumulated: harmless
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    with pytest.raises(EngineModuleError, match=r"engine.module.0.zero_grad\(\)"):
        engine.module[0].zero_grad()
    engine.destroy()
    return True


def _casts(stage: int) -> dict:
    engine, *_ = zengine.initialize(model=_model(), config=_config(stage, 1))
    rank, before = dist.get_rank(), None
    with engine.summon_full_params(writeback=False):
        before = _flat(engine.module)
    refused = {}
    for name, call in {
        "to_bf16": lambda m: m.to(torch.bfloat16),
        "half": lambda m: m.half(),
        "double": lambda m: m.double(),
        "layer_half": lambda m: m[2].half(),
        "to_empty": lambda m: m.to_empty(device="cpu"),
    }.items():
        try:
            call(engine.module)
            refused[name] = None
        except EngineModuleError as e:
            refused[name] = str(e)
    dtypes = {p.dtype for p in engine.module.parameters()}
    for call in (
        lambda m: m.float(),
        lambda m: m.to("cpu"),
        lambda m: m.cpu(),
        lambda m: engine.to("cpu"),
    ):
        call(engine.module)  # change nothing: harmless
    copied = copy.deepcopy(engine.module).half()  # a copy is the user's own plain module
    for x, y in _batches(1)[0]:
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    with engine.summon_full_params(writeback=False):
        after = _flat(engine.module)
    engine.destroy()
    copied = {str(p.dtype) for p in copied.parameters()}
    return refused, {str(d) for d in dtypes}, before.tolist(), after.tolist(), copied


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_casts_moves_and_partial_zero_grad_are_refused_or_followed(stage):
    expected = _model()
    opt = torch.optim.SGD(expected.parameters(), lr=0.1)
    x, y = _batches(1)[0][0]
    nn.functional.mse_loss(expected(x), y).backward()
    opt.step()
    for runs in spawn(_all_calls, 2, stage):
        refused, dtypes, before, after, copied = runs["casts"]
        # a sub-module's zero_grad mid-window refused; a device move followed, training after it
        # refused; .float() in a bf16 run refused (asserted on the ranks)
        assert (
            runs["submodule"] and runs["moved"] == {"meta"} and runs["bf16"] == {"torch.bfloat16"}
        )
        for name, message in refused.items():
            assert message is not None and "EngineModule" not in message, name
            assert "before zengine.initialize" in message
        assert "torch.bfloat16" in refused["to_bf16"] and "torch.float16" in refused["half"]
        assert dtypes == {"torch.float32"}
        assert (torch.tensor(before) - _flat(_model())).abs().max() == 0
        assert (torch.tensor(after) - _flat(expected)).abs().max() < 1e-6
        assert copied == {"torch.float16"}


def _fill(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.fill_(0.05)
            m.bias.fill_(-0.1)


def _other_state() -> dict:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).state_dict()


EDITS = {"apply": lambda m: m.apply(_fill), "load": lambda m: m.load_state_dict(_other_state())}


def _edited_reference(edit) -> torch.Tensor:
    """Plain torch, two steps, ``edit`` (None: none) on the module between them."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_batches(1)[0] + _batches(1)[1]):
        if i == 1 and edit is not None:
            edit(model)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _flat(model)


def _stage3_edits(persistence: int) -> dict:
    out = {}
    for name in EDITS:
        for gathered in (False, True):
            cfg = _config(3, 1)
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
            engine, *_ = zengine.initialize(model=_model(), config=cfg)
            rows = slice(dist.get_rank() * MICRO, (dist.get_rank() + 1) * MICRO)
            message = None
            for i, (x, y) in enumerate(_batches(1)[0] + _batches(1)[1]):
                if i == 1:
                    try:
                        if gathered:  # the way out the error names
                            with engine.summon_full_params():
                                EDITS[name](engine.module)
                        else:
                            EDITS[name](engine.module)
                    except EngineModuleError as e:
                        message = str(e)
                engine.backward(nn.functional.mse_loss(engine(x[rows]), y[rows]))
                engine.step()
            with engine.summon_full_params(writeback=False):
                out[(name, gathered)] = (message, _flat(engine.module).tolist())
            engine.destroy()
    return out


@pytest.mark.parametrize("persistence", [0, 1000])
def test_stage3_apply_and_load_outside_a_gather_are_refused_and_followed_inside(persistence):
    """Partitioned (threshold 0) or whole persistent parameters (1000): ``apply(fn)`` writing them and
    ``load_state_dict`` outside a gather raise and change nothing (they wrote nothing, or were lost at
    the next step, silently); inside ``summon_full_params`` they equal torch's edit."""
    for runs in spawn(_stage3_edits, 2, persistence):
        for (name, gathered), (message, weights) in runs.items():
            weights = torch.tensor(weights)
            if gathered:
                assert message is None, message
                assert (weights - _edited_reference(EDITS[name])).abs().max() < 1e-6, name
            else:
                assert message is not None and "summon_full_params" in message, name
                assert (weights - _edited_reference(None)).abs().max() < 1e-6, name
                assert (weights - _edited_reference(EDITS[name])).abs().max() > 1e-2, name


def _moved(stage: int) -> tuple:
    engine, *_ = zengine.initialize(model=_model(), config=_config(stage, 1))
    x, y = _batches(1, 1)[0][0]
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.module.to("meta")  # another device (as Lightning's teardown .cpu() on a GPU run)
    devices = {str(p.device) for p in engine.module.parameters()}
    with pytest.raises(
        EngineModuleError, match=r"engine.forward\(\) after engine.module was moved"
    ):
        engine(x)
    with pytest.raises(EngineModuleError, match="moved to another device"):
        engine.step()
    engine.destroy()
    return devices


def _bf16_casts(stage: int) -> tuple:
    cfg = _config(stage, 1)
    cfg["bf16"] = {"enabled": True}
    engine, *_ = zengine.initialize(model=_model(), config=cfg)
    engine.module.bfloat16()  # the configured dtype: changes nothing
    with pytest.raises(EngineModuleError, match="torch.bfloat16 on cpu -> torch.float32"):
        engine.module.float()
    x, y = _batches(1, 1)[0][0]
    engine.backward(nn.functional.mse_loss(engine(x).float(), y))  # trains on, in bf16
    engine.step()
    dtypes = {str(p.dtype) for p in engine.module.parameters()}
    engine.destroy()
    return dtypes


def _all_calls(stage: int) -> dict:
    """Every refusal and harmless call of one stage in one spawn (process start-up is most of it)."""
    return {
        "casts": _casts(stage),
        "submodule": _submodule_zero_grad(stage),
        "moved": _moved(stage),
        "bf16": _bf16_casts(stage),
    }
