"""Stage 3's DeepSpeed members for code that drives the model outside the engine
(``zero/stage3/parameter_offload.py``, ``external.py``): ``optimizer.parameter_offload`` with its
hook lists, ``param_coordinator`` and ``_register_deepspeed_module``; ``module.ds_external_parameters()``;
``param.ds_active_sub_modules``; ``zero.register_external_parameter``.

Between training steps each rank "generates" the way TRL's ``unwrap_model_for_generation`` does
(its sequence, written out here without TRL): either every parameter gathered, the hooks taken off,
forwards of ``engine.module`` as plain torch, the hooks put back; or forwards through the hooks
(the model reads ``a.weight`` outside ``a``: gathered for ``b`` when registered to it, else by the
external-use mode, which the root's hooks enter for a call outside the engine).
The forwards must equal plain torch at the same weights, the first way must issue no gather, the
hooks must come back once (not doubled), and training around them must equal plain torch on the
global batch.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zengine
from configs import stage3_config
from harness import spawn
from zengine.zero.stage3.param import ParamState, lookup

V, D, MICRO, STEPS, LR = 29, 12, 2, 4, 1e-2


class Mixer(nn.Module):
    """Reads a weight it does not own, handed to its forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h, w):
        return self.lin(h) + F.linear(h, w)


class Net(nn.Module):
    def __init__(self, register: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.a = nn.Linear(D, D)
        self.b = Mixer()
        self.head = nn.Linear(D, V)
        if register:  # as DeepSpeed's docs show: the user of the weight names it
            zengine.zero.register_external_parameter(self.b, self.a.weight)

    def forward(self, x, y=None):
        h = torch.tanh(self.a(self.emb(x)))
        logits = self.head(torch.tanh(self.b(h, self.a.weight)))
        return logits if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batches(world: int):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, V, (world * MICRO, 6), generator=g),
         torch.randint(0, V, (world * MICRO, 6), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip


def _hooks_off(engine):
    """TRL's remove_hooks (trl/models/utils.py), as it reads the engine."""
    offload = engine.optimizer.parameter_offload
    for _, p in [*offload.module.named_parameters(), *offload.module.ds_external_parameters()]:
        p.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks:
        hook.remove()
    for hook in offload.backward_hooks:
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _hooks_on(engine):
    """TRL's add_hooks."""
    offload = engine.optimizer.parameter_offload
    coordinator = offload.param_coordinator
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _generate(engine, reference, x, gather: bool) -> dict:
    """Forwards of engine.module outside the engine, as TRL generates; the largest difference from
    plain torch and the gathers issued."""
    check = engine.optimizer.fetcher.check
    before = check.issued_count
    with torch.no_grad():
        want = [reference(x[:, : n + 1]) for n in range(3)]
        if gather:
            with zengine.zero.GatheredParameters(engine.module.parameters()):
                _hooks_off(engine)
                got = [engine.module(x[:, : n + 1]) for n in range(3)]
                _hooks_on(engine)
        else:
            got = [engine.module(x[:, : n + 1]) for n in range(3)]
    released = all(sp.state is ParamState.SHARDED for sp in engine.optimizer.all_sharded)
    return {
        "diff": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "gathers": check.issued_count - before,
        "released": released,
    }


def _run(register: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net(register)
    reference = copy.deepcopy(model)
    config = stage3_config()
    config.update(optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
                  train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=1)  # fmt: skip
    engine, *_ = zengine.initialize(model=model, config=config)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    offload = engine.optimizer.parameter_offload
    hooks_at_start = (len(offload.forward_hooks), len(offload.backward_hooks))
    a_weight = lookup(engine.module.a.weight)
    out = {
        "module": offload.module is engine.module,
        "every_module_has_lookup": all(
            callable(getattr(m, "ds_external_parameters", None)) for m in engine.module.modules()
        ),
        "externals_of_b": [p is engine.module.a.weight for _, p in engine.module.b.ds_external_parameters()],
        "b_gathers_a": any(sp is a_weight for sp in engine.optimizer.module_hooks.units.get(engine.module.b, [])),
        "generations": [],
    }  # fmt: skip
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    for step, (x, y) in enumerate(_batches(world)):
        if step > 0:  # between steps: generate, one way then the other
            generation = _generate(engine, reference, x[mine], gather=step % 2 == 1)
            generation["invalid"] = offload.param_coordinator.is_invalid_trace()
            out["generations"].append(generation)
        loss = engine(x[mine], y[mine])
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step()
    out["recorded_again"] = offload.param_coordinator.is_complete_trace()
    out["hooks"] = (hooks_at_start, (len(offload.forward_hooks), len(offload.backward_hooks)))
    # registering again with the hooks in place replaces them: still one set, training unchanged
    offload._register_deepspeed_module(offload.module)
    out["hooks_twice"] = (len(offload.forward_hooks), len(offload.backward_hooks))
    with pytest.raises(RuntimeError, match="already invalid"):
        offload.param_coordinator._invalidate_trace()
    with pytest.raises(ValueError, match="whole model"):
        offload._register_deepspeed_module(engine.module.b)
    x, y = _batches(world)[0]
    engine.backward(engine(x[mine], y[mine]))
    engine.step()
    ref_opt.zero_grad()
    reference(x, y).backward()
    ref_opt.step()
    with engine.summon_full_params(writeback=False):
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out["diff"] = max((got[n] - p).abs().max().item() for n, p in reference.named_parameters())
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_generation_outside_the_engine_and_training_equal_torch(world):
    for register in (True, False):
        for r, out in enumerate(spawn(_run, world, register)):
            assert out["module"] and out["every_module_has_lookup"], r
            assert out["externals_of_b"] == ([True] if register else [])
            assert out["b_gathers_a"] is register  # registered: gathered with b's own
            assert out["diff"] < 1e-5, (register, r, out["diff"])
            gathered, hooked = out["generations"][0::2], out["generations"][1::2]
            for g in gathered + hooked:
                assert g["diff"] < 1e-5 and g["released"], g
            # hooks off: GatheredParameters' one gather, the trace dropped; through the hooks: a
            # gather per unit and forward, the trace kept (re-recorded by the step before)
            assert all(g["gathers"] == 1 and g["invalid"] for g in gathered), gathered
            assert all(g["gathers"] >= 3 * 4 and not g["invalid"] for g in hooked), hooked
            assert out["recorded_again"]
            # units: emb, a, b.lin, head, and b when a.weight is registered to it; and the root's
            # pair (the external-use mode for calls outside the engine)
            start, end = out["hooks"]
            assert start == end == out["hooks_twice"], out["hooks"]
            assert start[0] == 2 * (5 if register else 4) + 2, start


def test_external_parameter_registration_is_refused_by_name():
    net = Net(register=False)
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        zengine.zero.unregister_external_parameter(net.b, net.a.weight)
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        zengine.zero.register_external_parameter(net.b, torch.zeros(2))
    zengine.zero.register_external_parameter(net.b, net.a.weight)
    assert [p is net.a.weight for _, p in net.b.ds_external_parameters()] == [True]
    zengine.zero.unregister_external_parameter(net.b, net.a.weight)
    assert list(net.b.ds_external_parameters()) == []
