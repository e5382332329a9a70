"""fp16 master weights and gradients (DeepSpeed's ``fp16.fp16_master_weights_and_grads``) at
stages 1-3, in memory and with the optimizer offloaded, against a single-process reference of the
mode's own arithmetic: the fp16 model on the global batch, its loss times the same loss scale,
the gradient unscaled into fp16, clipped, and Adam with fp32 moments over the fp16 parameters,
each rounded to nearest. A run with fp32 masters (fp16's default) is the deliberately wrong
reference the mode must be told apart from."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zengine
from configs import PARITY_CLIP, PARITY_MICRO, parity_config
from harness import spawn
from models import (
    EdgeNet,
    edge_param_groups,
    make_batches,
    train_edge_engine,
    train_global_batch,
    whole_states,
)

STEPS = 5
SCALE = 2.0**8  # parity_config's initial_scale_power under fp16
# A small learning rate: each update is a few fp16 ulps of a weight, so the fp16 masters' rounding
# moves the run measurably away from fp32 masters (the test tells the two apart)
LR = 3e-4


def fp16_config(stage, gas, world, offload=False, masters=True):
    cfg = parity_config(stage, "fp16", gas, world, offload)
    cfg["optimizer"]["params"]["lr"] = LR
    cfg["fp16"]["fp16_master_weights_and_grads"] = masters
    return cfg


def train(stage, gas, offload=False, masters=True):
    world = dist.get_world_size()
    return train_edge_engine(fp16_config(stage, gas, world, offload, masters), STEPS, gas, LR)


def fp16_master_reference(init, batches):
    """The mode on one process: fp16 parameters are the masters, gradients unscaled into fp16,
    clipped by the global norm, zengine's CPUAdam (fp32 moments, fp32 arithmetic, nearest)."""
    from zengine.ops import CPUAdam

    model = copy.deepcopy(init).half()
    opt = CPUAdam(edge_param_groups(model, LR), lr=LR)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        (loss * SCALE).backward()
        with_grad = [p for p in model.parameters() if p.grad is not None]
        for p in with_grad:
            p.grad = (p.grad.float() / SCALE).half()
        torch.nn.utils.clip_grad_norm_(with_grad, PARITY_CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def distance(a, b) -> float:
    return sum(((a[n] - b[n]) ** 2).sum() for n in b).sqrt().item()


def errors(stage, gas, offload=False):
    """(off the fp16-master reference / its movement, off the fp32-master run / that movement
    (None where offloaded: the in-memory cases show it), worst relative loss error, the movement,
    kinds)."""
    losses, params, init, batches, kinds = train(stage, gas, offload)
    wrong = None if offload else train(stage, gas, offload, masters=False)[1]
    ref_losses, ref = fp16_master_reference(init, batches)
    start = {n: p.detach().half().float() for n, p in init.named_parameters()}
    moved = distance(ref, start)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    off_wrong = distance(params, wrong) / moved if wrong else None
    return distance(params, ref) / moved, off_wrong, loss_err, moved, kinds


# Measured at W=2/3 (fp16 gradient sums in another order than the reference's one backward):
# off the reference 0.0014-0.0115 of the movement, off the fp32-master run 0.32-0.35.
MOVE_TOL, LOSS_TOL = 0.04, 1e-3


def check(cases):
    out = []
    for case in cases:
        off, off_wrong, loss_err, moved, kinds = errors(*case)
        assert moved > 0.05, (
            f"{case}: the reference moved only {moved:.3g}: the test could not fail"
        )
        assert off <= MOVE_TOL, f"{case}: off by {off:.3g} of the movement"
        if off_wrong is not None:
            assert off_wrong >= 3 * off, f"{case}: fp32 masters {off_wrong:.3g} vs {off:.3g}"
        assert loss_err <= LOSS_TOL, f"{case}: loss off by {loss_err:.3g}"
        # NVMe: the moments (and at stage 3 the record) live in the swap file
        stepper = {"nvme": "SwappedAdam", "infinity": "InfinityAdam"}.get(case[2:3] and case[2])
        states = [] if stepper else ["torch.float32"]
        assert kinds["states"] == states and kinds["masters"] == ["torch.float16"], kinds
        assert kinds["class"] == (stepper or "CPUAdam"), kinds
        assert kinds["skipped"] == 0, kinds
        out.append((off, off_wrong, loss_err))
    return out


CASES = [
    (1, 2),
    (1, 1, True),
    (2, 2, True),
    (3, 1, True),
    (3, 2),
    (2, 1, "nvme"),
    (3, 1, "infinity"),
]


# one rank runs every case; four ranks the stages with accumulation and CPU offload (the suite's time)
CASES_BY_WORLD = {1: CASES, 2: CASES, 3: CASES, 4: [(1, 2), (2, 2, True), (3, 2)]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fp16_masters_match_the_fp16_master_reference(world):
    spawn(check, world, CASES_BY_WORLD[world])


def _overflow_run(stage: int, offload):
    """Steps 0-3 with fp16 masters; at step 2 rank 0's loss is made infinite. Returns each step's
    (applied, parameters unchanged), the skipped count and the final loss scale."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=fp16_config(stage, 1, world, offload),
        model_parameters=edge_param_groups(model, LR),
    )
    out = []
    for i, (x, y) in enumerate(make_batches(4, PARITY_MICRO * world)):
        with engine.summon_full_params(writeback=False):
            before = [p.detach().clone() for p in engine.module.parameters()]
        mine = slice(dist.get_rank() * PARITY_MICRO, (dist.get_rank() + 1) * PARITY_MICRO)
        loss = engine(x[mine], y[mine])
        if i == 2 and dist.get_rank() == 0:
            loss = loss * float("inf")  # an fp16 overflow on one rank only
        engine.backward(loss)
        engine.step()
        with engine.summon_full_params(writeback=False):
            same = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
            finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
        out.append((engine.was_step_applied(), same, finite))
    masters_finite = all(torch.isfinite(m).all().item() for m in engine.optimizer.masters)
    return out, engine.skipped_steps, masters_finite


def _overflow_runs(cases):
    return [_overflow_run(*case) for case in cases]


def test_overflow_skips_the_step_on_every_rank():
    for runs in spawn(_overflow_runs, 2, [(2, True), (3, False)]):
        for steps, skipped, masters_finite in runs:
            assert [applied for applied, *_ in steps] == [True, True, False, True], steps
            assert [same for _, same, _ in steps] == [False, False, True, False], steps
            assert all(finite for *_, finite in steps) and masters_finite, steps
            assert skipped == 1


def _refused(fp16: dict, zero=None, optimizer=None, client=False):
    world = dist.get_world_size()
    cfg = parity_config(2, "fp16", 1, world)
    cfg["fp16"].update(fp16)
    cfg["zero_optimization"].update(zero or {})
    if optimizer:
        cfg["optimizer"] = optimizer
    model = EdgeNet()
    extra = {}
    if client:
        from zengine.ops import CPUAdam

        cfg.pop("optimizer")
        cls = CPUAdam if client == "CPUAdam" else torch.optim.AdamW
        extra["optimizer"] = cls(model.parameters(), lr=LR)
    try:
        engine, *_ = zengine.initialize(
            model=model, config=cfg, model_parameters=model.parameters(), **extra
        )
    except (ValueError, zengine.config.ConfigError) as err:
        return str(err)
    train_global_batch(engine, make_batches(1, PARITY_MICRO * world)[0], PARITY_MICRO, 1)
    opt = engine.optimizer
    return sorted(
        {str(t.dtype) for s in opt.optimizer.state.values() for t in s.values() if t.dim()}
        | {str(m.dtype) for m in opt.masters}
    )


MASTERS = {"fp16_master_weights_and_grads": True}
REFUSALS = [
    ({**MASTERS, "enabled": False}, None, None, False, "fp16 masters need fp16 compute"),
    (MASTERS, {"stage": 0}, None, False, "stages 1-3"),
    (MASTERS, None, {"type": "SGD", "params": {"lr": 0.1}}, False, "fp32 moments"),
    (MASTERS, None, None, True, "the script's optimizer keeps its states"),
]


def _all_refused(cases):
    return [_refused(*case[:-1]) for case in cases]


def test_refused_by_name_on_every_rank():
    """Each refusal names the key on every rank; a script's zengine.ops.CPUAdam (DeepSpeed's
    DeepSpeedCPUAdam case) is accepted and keeps fp32 moments over the fp16 masters."""
    accepted = (MASTERS, None, None, "CPUAdam", None)
    for texts in spawn(_all_refused, 2, REFUSALS + [accepted]):
        for text, case in zip(texts[:-1], REFUSALS):
            assert isinstance(text, str) and case[-1] in text and "fp16" in text, (case, text)
        assert texts[-1] == ["torch.float16", "torch.float32"], texts[-1]


def _ckpt_engine(stage: int, masters: bool):
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=fp16_config(stage, 1, dist.get_world_size(), masters=masters),
        model_parameters=edge_param_groups(model, LR),
    )
    return engine


def _ckpt_save(stage: int, masters: bool, folder: str) -> dict:
    engine = _ckpt_engine(stage, masters)
    for b in make_batches(3, PARITY_MICRO * dist.get_world_size(), seed=1):
        train_global_batch(engine, b, PARITY_MICRO, 1)
    engine.save_checkpoint(folder, tag="t")
    return whole_states(engine), engine.loss_scale, _ckpt_continue(engine)


def _ckpt_continue(engine) -> list[float]:
    """Two more steps on a global batch of 6 that W=2 and W=3 split evenly."""
    world = dist.get_world_size()
    return [train_global_batch(engine, b, 6 // world, 1) for b in make_batches(2, 6, seed=2)]


def _ckpt_load(stage: int, masters: bool, folder: str):
    engine = _ckpt_engine(stage, masters)
    engine.load_checkpoint(folder, tag="t")
    values = whole_states(engine)
    losses = _ckpt_continue(engine)
    dtypes = sorted({str(m.dtype) for m in engine.optimizer.masters})
    return values, engine.loss_scale, losses, dtypes


CKPT_CASES = [
    # (saving world, stage, fp16 masters) -> (loading world, stage, fp16 masters)
    ((2, 2, False), (3, 3, True)),
    ((3, 3, True), (2, 1, False)),
]


@pytest.mark.parametrize("saving,loading", CKPT_CASES)
def test_checkpoint_across_master_precisions(tmp_path, saving, loading):
    """fp32 masters load into fp16 masters rounded to nearest, fp16 ones into fp32 exactly; the
    fp32 moments, the fp16 parameters and the loss scale are the saved ones."""
    folder = str(tmp_path / "ckpt")
    saved, scale, going_on = spawn(_ckpt_save, *saving, folder)[0]
    for values, loaded_scale, losses, dtypes in spawn(_ckpt_load, *loading, folder):
        assert set(values) == set(saved) and loaded_scale == scale
        for key in saved:
            want, got = torch.tensor(saved[key]), torch.tensor(values[key])
            if key.startswith("master/") and loading[2]:
                want = want.half().float()
            assert torch.equal(got, want), key
        assert dtypes == (["torch.float16"] if loading[2] else ["torch.float32"])
        # training goes on as the saving run did (the masters' precision aside: measured within
        # 7e-4 of its losses, the first step within 1e-7)
        assert losses == pytest.approx(going_on, rel=1e-3), (losses, going_on)


def _memory(stage: int, masters: bool):
    """memory_breakdown after one step with fp16 or fp32 masters, the elements this rank owns,
    and whether the fp16 masters are the parameter shards' own storage."""
    world = dist.get_world_size()
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=fp16_config(stage, 1, world, masters=masters),
        model_parameters=edge_param_groups(model, LR),
    )
    train_global_batch(engine, make_batches(1, PARITY_MICRO * world)[0], PARITY_MICRO, 1)
    opt = engine.optimizer
    owned = sum(m.numel() for m in opt.masters)
    shared = [m.data_ptr() == g.owned_params().data_ptr() for m, g in zip(opt.masters, opt.groups)]
    return engine.memory_breakdown(), owned, all(shared)


def _memories(masters: bool):
    return [_memory(stage, masters) for stage in (1, 2, 3)]


def test_memory_breakdown_counts_two_byte_masters():
    """fp16 masters cost no bytes beside the parameters (the shard is the master) and fp32
    moments 8 bytes per owned element; fp32 masters 4 more bytes per owned element."""
    for lows, highs in zip(spawn(_memories, 2, True), spawn(_memories, 2, False)):
        for stage, (low, owned, shared), (high, _, _) in zip((1, 2, 3), lows, highs):
            assert shared and low["master_weights"] == 0, low
            assert low["optimizer_states"] >= 8 * owned
            # fp32 masters: 4 more bytes per owned element beside the fp16 parameters at stages
            # 1-2; at stage 3 the shard itself is kept in fp32 (it is the master, the gathers
            # cast): 2 more than the fp16 shard that is the fp16 master
            extra = high["master_weights"] + high["parameters"] - low["parameters"]
            assert extra >= (2 if stage == 3 else 4) * owned, (stage, low, high)
            assert low["optimizer_states"] == high["optimizer_states"]
            if stage >= 2:  # the gradient shard: in the master's dtype, 2 bytes against 4
                assert low["gradients"] < high["gradients"], (stage, low, high)
