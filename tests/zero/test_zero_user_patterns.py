"""How users actually drive the engine, beyond ``loss = engine(x); engine.backward(loss); engine.step()``.

1. several ``engine.backward()`` calls before one ``step()`` add up like one backward of the summed losses;
2. a plain ``loss.backward()`` then ``engine.step()`` (DeepSpeed scripts) trains like ``engine.backward``,
   and a model output the engine cannot look into is refused by name when the factor is not 1;
3. a NaN loss (on one rank or all) skips the step on every rank; too many in a row raise naming a
   parameter; ``nonfinite_gradients.skip: false`` applies it;
4. ranks out of step at a boundary raise ``RanksOutOfStepError`` on every rank, naming each rank's
   micro-step (a rank that skips a whole step: ``tests/distributed/test_distributed_diagnose.py``);
5. ``step()`` with no backward since the last one does nothing and is not counted.

Each spawned run covers every case of one stage (or every stage) to save process start-up time.
"""

import math
import re

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, micro_batch, reference_run
from test_zero_parity import CLIP, LR, MICRO, engine_config
from zengine import NonFiniteGradientError, RanksOutOfStepError

STEPS = 3
STAGES = (0, 1, 2, 3)


# -- helpers --------------------------------------------------------------------------------------
def make_engine(stage, precision="fp32", gas=1, model_cls=EdgeNet, **overrides):
    """A fresh EdgeNet (same initial weights every time) wrapped with the parity suite's config."""
    torch.manual_seed(0)
    model = model_cls()
    cfg = engine_config(stage, precision, gas, dist.get_world_size())
    cfg.update(overrides)
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    return engine


def full_params(engine):
    """Every parameter whole, as fp32 (collective at stage 3)."""
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def snapshot(engine):
    """Parameters, fp32 masters and optimizer state tensors of this rank: for bit-for-bit comparisons."""
    state = [
        t.clone()
        for sp in engine.optimizer.shard_params
        for t in engine.optimizer.state.get(sp, {}).values()
        if torch.is_tensor(t)
    ]
    return full_params(engine), [m.detach().clone() for m in engine.optimizer.masters], state


def assert_same_snapshot(a, b, what):
    pa, ma, sa = a
    pb, mb, sb = b
    for n in pa:
        assert torch.equal(pa[n], pb[n]), f"{what}: parameter {n} changed"
    assert len(ma) == len(mb) and all(torch.equal(x, y) for x, y in zip(ma, mb)), (
        f"{what}: an fp32 master changed"
    )
    assert len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb)), (
        f"{what}: optimizer state changed"
    )


def assert_params_close(a, b, rel, what, start=None):
    """||a - b|| within ``rel`` of how far the parameters moved from ``start`` (or of ||b||)."""
    off = math.sqrt(sum(((a[n] - b[n]) ** 2).sum().item() for n in b))
    scale = (
        math.sqrt(sum(((b[n] - start[n]) ** 2).sum().item() for n in b))
        if start
        else math.sqrt(sum((b[n] ** 2).sum().item() for n in b))
    )
    assert scale > 1e-3, (
        f"{what}: the parameters did not move ({scale:.3g}): the comparison could not fail"
    )
    assert off <= rel * scale, (
        f"{what}: parameters differ by {off:.3g} ({off / scale:.3g} relative)"
    )


def moved(a, b) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a)


# -- 1. several backward calls before one step ----------------------------------------------------
def two_backward_run(stage, gas, mode):
    """3 steps where each micro-batch's gradient comes from ``mode``:

    "separate": l1 (first half) and l2 (second half) by two forwards, backward(l1); backward(l2)
    "summed":   the same two forwards, backward(l1 + l2)
    "retain":   one forward of the whole micro-batch, backward(loss, retain_graph=True); backward(loss)
    "double":   one forward, backward(2 * loss)
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = make_engine(stage, "fp32", gas)
    batches = make_batches(STEPS, MICRO * gas * world)
    norms = []
    for batch in batches:
        for m in range(gas):
            x, y = micro_batch(batch, rank, world, MICRO, m)
            if mode in ("separate", "summed"):
                l1, l2 = engine(x[:1], y[:1]), engine(x[1:], y[1:])
                if mode == "separate":
                    engine.backward(l1)
                    engine.backward(l2)
                else:
                    engine.backward(l1 + l2)
            else:
                loss = engine(x, y)
                if mode == "retain":
                    engine.backward(loss, retain_graph=True)
                    engine.backward(loss)
                else:
                    engine.backward(2 * loss)
            engine.step()
        assert engine.was_step_applied()
        norms.append(engine.get_global_grad_norm())
    return norms, full_params(engine)


def two_backwards_matrix(stages, gases, retain=True):
    world = dist.get_world_size()
    torch.manual_seed(0)
    init = EdgeNet()
    start = {n: p.detach().clone() for n, p in init.named_parameters()}
    for stage in stages:
        for gas in gases:
            case = f"stage {stage} gas {gas} world {world}"
            # Anchor against plain torch: l1 + l2 (and 2 * loss) is twice the mean loss of the micro-batch,
            # so the norm is twice the reference's; every norm is above the clip, so after clipping the
            # update, and hence the parameters, are the reference's.
            ref_norms = []
            _, ref = reference_run(
                init, make_batches(STEPS, MICRO * gas * world), LR, CLIP, norms=ref_norms
            )
            assert min(ref_norms) > 2 * CLIP
            sep_norms, sep = two_backward_run(stage, gas, "separate")
            sum_norms, summed = two_backward_run(stage, gas, "summed")
            assert sep_norms == pytest.approx(sum_norms, rel=1e-5), (
                f"{case}: backward(l1); backward(l2) vs l1 + l2"
            )
            assert_params_close(
                sep, summed, 1e-5, f"{case} backward(l1); backward(l2) vs backward(l1 + l2)", start
            )
            assert sum_norms == pytest.approx([2 * r for r in ref_norms], rel=1e-5), case
            assert_params_close(summed, ref, 1e-4, f"{case} backward(l1 + l2) vs torch", start)
            if retain:
                ret_norms, ret = two_backward_run(stage, gas, "retain")
                dbl_norms, dbl = two_backward_run(stage, gas, "double")
                assert ret_norms == pytest.approx(dbl_norms, rel=1e-5), (
                    f"{case}: twice with retain_graph vs 2 * loss"
                )
                assert_params_close(
                    ret, dbl, 1e-5, f"{case} twice with retain_graph vs backward(2 * loss)", start
                )
                assert dbl_norms == pytest.approx([2 * r for r in ref_norms], rel=1e-5), case


@pytest.mark.parametrize("stage", STAGES)
def test_two_backwards_before_one_step_add_up(stage):
    spawn(two_backwards_matrix, 2, [stage], [1, 2])


def test_two_backwards_before_one_step_add_up_three_ranks():
    spawn(two_backwards_matrix, 3, [1], [1, 2])


# -- 2. plain loss.backward() then engine.step() --------------------------------------------------
class LossBox:
    """A model output the engine cannot look into (not a tensor, tuple, list or dict)."""

    def __init__(self, loss):
        self.loss = loss


class BoxedEdgeNet(EdgeNet):
    def forward(self, x, y):
        return LossBox(super().forward(x, y))


def backward_style_run(stage, precision, gas, style, boxed=False, **overrides):
    """3 steps with engine.backward(loss) ("engine") or loss.backward() ("plain")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = make_engine(stage, precision, gas, BoxedEdgeNet if boxed else EdgeNet, **overrides)
    norms, scales = [], []
    for batch in make_batches(STEPS, MICRO * gas * world):
        for m in range(gas):
            x, y = micro_batch(batch, rank, world, MICRO, m)
            out = engine(x, y)
            loss = out.loss if boxed else out
            if style == "engine":
                engine.backward(loss)
            else:
                loss.backward()
            engine.step()
        assert engine.was_step_applied()
        norms.append(engine.get_global_grad_norm())
        scales.append(engine.loss_scale)
    return norms, full_params(engine), scales


FP16_STATIC = {"fp16": {"enabled": True, "loss_scale": 128}}


FP16_PLAIN_TOL = 2e-3  # fp16 rounding of unscaled vs scaled gradients over a few steps (a factor error is >= 0.5)


def plain_backward_matrix(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    init = EdgeNet()
    start = {n: p.detach().clone() for n, p in init.named_parameters()}
    cases = [("fp32", 2, {}), ("fp16", 2, FP16_STATIC), ("fp16", 1, FP16_STATIC)]
    for precision, gas, overrides in cases:
        case = f"stage {stage} {precision} gas {gas}"
        e_norms, e_params, _ = backward_style_run(stage, precision, gas, "engine", **overrides)
        p_norms, p_params, p_scales = backward_style_run(
            stage, precision, gas, "plain", **overrides
        )
        # fp16: a plain backward runs without the loss scale (the engine never sees the loss), so the two
        # differ by fp16's rounding of unscaled against scaled gradients, not by a factor
        tol = 1e-6 if precision == "fp32" else FP16_PLAIN_TOL
        assert p_norms == pytest.approx(e_norms, rel=tol), (
            f"{case}: loss.backward() vs engine.backward()"
        )
        assert_params_close(
            p_params, e_params, tol, f"{case}: loss.backward() vs engine.backward()", start
        )
        if precision == "fp16":
            assert p_scales == [128.0] * STEPS, p_scales
    # fp32 against plain torch too: the factor 1/gas was applied exactly once
    ref_norms = []
    _, ref = reference_run(init, make_batches(STEPS, MICRO * 2 * world), LR, CLIP, norms=ref_norms)
    p_norms, p_params, _ = backward_style_run(stage, "fp32", 2, "plain")
    assert p_norms == pytest.approx(ref_norms, rel=1e-5), f"stage {stage}: loss.backward() vs torch"
    assert_params_close(p_params, ref, 1e-5, f"stage {stage}: loss.backward() vs torch", start)

    # A forward output the engine cannot hook: in fp32 no factor is needed (the step divides by the
    # accumulation steps), so a plain backward is fine at gas 1 and 2 ...
    for gas in (1, 2):
        e_norms, e_params, _ = backward_style_run(stage, "fp32", gas, "engine", boxed=True)
        p_norms, p_params, _ = backward_style_run(stage, "fp32", gas, "plain", boxed=True)
        assert p_norms == pytest.approx(e_norms, rel=1e-6), f"stage {stage}: boxed loss, gas {gas}"
        assert_params_close(
            p_params, e_params, 1e-6, f"stage {stage}: boxed loss, gas {gas}", start
        )
    # ... and with fp16 too: nothing is multiplied on the way, the step divides by what the pass carried (1)
    e_norms, e_params, _ = backward_style_run(stage, "fp16", 2, "engine", boxed=True, **FP16_STATIC)
    p_norms, p_params, _ = backward_style_run(stage, "fp16", 2, "plain", boxed=True, **FP16_STATIC)
    assert p_norms == pytest.approx(e_norms, rel=FP16_PLAIN_TOL), f"stage {stage}: boxed fp16 loss"
    assert_params_close(
        p_params, e_params, FP16_PLAIN_TOL, f"stage {stage}: boxed fp16 loss", start
    )


@pytest.mark.parametrize("stage", STAGES)
def test_plain_loss_backward_then_step(stage):
    spawn(plain_backward_matrix, 2, stage)


# -- 3. non-finite losses --------------------------------------------------------------------------
def nan_run(stage, precision, nan_steps, nan_ranks, steps, record=None, **overrides):
    """Train ``steps`` steps; at the steps in ``nan_steps`` the ranks in ``nan_ranks`` multiply the loss
    by NaN. Returns the per-step record (appended to ``record``) and the engine. Asserts each skipped step
    left everything alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = make_engine(stage, precision, 1, **overrides)
    batches = make_batches(steps, MICRO * world)
    record = [] if record is None else record
    for i, batch in enumerate(batches):
        before = snapshot(engine)
        x, y = micro_batch(batch, rank, world, MICRO, 0)
        loss = engine(x, y)
        if i in nan_steps and rank in nan_ranks:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        after = snapshot(engine)
        record.append(
            (
                engine.was_step_applied(),
                engine.skipped_steps,
                engine.get_global_grad_norm(),
                engine.global_steps,
            )
        )
        if not engine.was_step_applied():
            assert_same_snapshot(
                before, after, f"stage {stage} {precision} skipped step {i} on rank {rank}"
            )
        else:
            assert moved(before[0], after[0]), (
                f"stage {stage} {precision} step {i} applied but nothing moved"
            )
    return record, engine


def nonfinite_matrix(stage):
    rank, world = dist.get_rank(), dist.get_world_size()
    for precision in ("fp32", "bf16"):
        # a clean run on batches 0, 2, 3: what a NaN at step 1 must leave behind once it is skipped
        clean_engine = make_engine(stage, precision, 1)
        for i, batch in enumerate(make_batches(4, MICRO * world)):
            if i != 1:
                x, y = micro_batch(batch, rank, world, MICRO, 0)
                clean_engine.backward(clean_engine(x, y))
                clean_engine.step()
        clean = full_params(clean_engine)
        for nan_ranks in ([1], list(range(world))):  # on one rank only, and on every rank
            case = f"stage {stage} {precision} NaN on ranks {nan_ranks}"
            record, engine = nan_run(stage, precision, {1}, nan_ranks, 4)
            applied = [r[0] for r in record]
            assert applied == [True, False, True, True], f"{case}: {record}"
            assert [r[1] for r in record] == [0, 1, 1, 1], f"{case}: skipped_steps {record}"
            norms = [r[2] for r in record]
            assert not math.isfinite(norms[1]) and all(
                math.isfinite(n) for n in norms[:1] + norms[2:]
            ), case
            # the skipped step left no trace: gradients dropped, optimizer state and LR untouched
            final = full_params(engine)
            for n in clean:
                assert torch.equal(final[n], clean[n]), (
                    f"{case}: {n} differs from a run without that step"
                )

        # max_consecutive_skips in a row raise, naming a parameter; a finite step resets the count
        names = {n for n, p in EdgeNet().named_parameters() if p.requires_grad}
        record = []
        with pytest.raises(NonFiniteGradientError) as err:
            nan_run(
                stage,
                precision,
                {1, 2, 4, 5, 6},
                [1],
                8,
                record,
                nonfinite_gradients={"max_consecutive_skips": 3},
            )
        assert len(record) == 6, (
            f"stage {stage} {precision}: raised at step {len(record)}, not 6: {record}"
        )
        assert [r[1] for r in record] == [0, 1, 2, 2, 3, 4], record
        message = str(err.value)
        named = re.search(r"non-finite is '([^']+)'", message)
        assert named and named.group(1) in names, message
        assert "3 boundary steps in a row" in message, message

        # the opt-out: skip false applies the step, and the NaN reaches the parameters
        record, engine = nan_run(stage, precision, {1}, [1], 2, nonfinite_gradients={"skip": False})
        assert [r[0] for r in record] == [True, True] and record[-1][1] == 0, record
        assert not math.isfinite(record[-1][2])
        params = full_params(engine)
        assert torch.isnan(params["fc1.weight"]).all() and torch.isnan(params["emb.weight"]).all()
        torch.manual_seed(0)
        init = EdgeNet().state_dict()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for n in ("frozen.weight", "unused.weight", "unused.bias"):  # no rank gave them a gradient
            assert torch.equal(params[n], init[n].to(dtype).float()), n


@pytest.mark.parametrize("stage", STAGES)
def test_nan_loss_skips_on_every_rank(stage):
    spawn(nonfinite_matrix, 2, stage)


# -- 4. ranks out of step -------------------------------------------------------------------------
# A rank that skips a whole step is caught when the ranks' ends differ: tests/distributed/test_distributed_diagnose.py.
def one_rank_without_backward(stages):
    """Rank 1 calls step() with no backward at a boundary where rank 0 did one (under no_sync, so that no
    gradient collective is left unmatched): the step's all-reduce sees it and every rank raises."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for stage in stages:
        engine = make_engine(stage, "fp32", 1)
        x, y = micro_batch(make_batches(1, MICRO * world)[0], rank, world, MICRO, 0)
        engine.backward(engine(x, y))
        engine.step()  # one normal step: micro-step 1
        try:
            if rank == 0:
                with engine.no_sync():
                    engine.backward(engine(x, y))
            engine.step()
        except RanksOutOfStepError as e:
            out.append(str(e))
        else:
            out.append(None)
    return out


def test_rank_without_backward_at_step_raises_out_of_step():
    stages = [
        0,
        1,
        2,
    ]  # stage 3's forward gathers parameters: a rank without forward would leave them unmatched
    results = spawn(one_rank_without_backward, 2, stages, timeout=60)
    for rank, messages in enumerate(results):
        for stage, message in zip(stages, messages):
            assert message is not None, (
                f"stage {stage}: rank {rank} did not raise RanksOutOfStepError"
            )
            assert "rank 0: micro-step 1, its last backward under no_sync\n" in message, message
            assert "rank 1: micro-step 1, no backward since the last step" in message, message


# -- 5. step() without backward -------------------------------------------------------------------
def idle_steps(stages):
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(STEPS, MICRO * world)
    for stage in stages:
        plain = make_engine(stage, "fp32", 1)
        for batch in batches:
            x, y = micro_batch(batch, rank, world, MICRO, 0)
            plain.backward(plain(x, y))
            plain.step()
        expected, expected_norm = full_params(plain), plain.get_global_grad_norm()

        engine = make_engine(stage, "fp32", 1)
        before = snapshot(engine)
        engine.step()  # before any backward at all
        assert_same_snapshot(before, snapshot(engine), f"stage {stage}: step() before any backward")
        assert (engine.global_steps, engine.micro_steps, engine.was_step_applied()) == (0, 0, False)
        for i, batch in enumerate(batches):
            x, y = micro_batch(batch, rank, world, MICRO, 0)
            engine.backward(engine(x, y))
            engine.step()
            assert engine.was_step_applied() and engine.global_steps == i + 1
            norm, before = engine.get_global_grad_norm(), snapshot(engine)
            engine.step()  # again, with no backward since
            assert_same_snapshot(
                before, snapshot(engine), f"stage {stage}: second step() of step {i}"
            )
            assert not engine.was_step_applied(), (
                f"stage {stage}: second step() reported as applied"
            )
            assert (engine.global_steps, engine.micro_steps) == (i + 1, i + 1), (
                f"stage {stage}: counted"
            )
            assert engine.get_global_grad_norm() == norm
        got = full_params(engine)
        for n in expected:  # and the idle steps left no trace in the training
            assert torch.equal(got[n], expected[n]), (
                f"stage {stage}: {n} differs from a run without idle steps"
            )
        assert engine.get_global_grad_norm() == expected_norm


def test_step_without_backward_does_nothing():
    spawn(idle_steps, 2, list(STAGES))
