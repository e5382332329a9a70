"""bf16 master weights, gradients and optimizer states (DeepSpeed's ``bf16_master_weights_and_grads``
and ``bf16_optimizer_states``) at stages 1-3, against torch AdamW on bf16 parameters on one
process (it keeps bf16 moments: the natural reference), the same global batch, several steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zengine
from configs import NO_PREFETCH, PARITY_CLIP, PARITY_LR, PARITY_MICRO, ds_config, parity_config
from harness import spawn
from models import (
    EdgeNet,
    edge_param_groups,
    make_batches,
    reference_run,
    train_edge_engine,
    train_global_batch,
)

STEPS = 6
MASTERS = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
FP16_MASTERS = {"fp16_master_weights_and_grads": True}


def bf16_config(stage, gas, world, offload=False, rounding="nearest", states=True):
    cfg = parity_config(stage, "bf16", gas, world, offload)
    cfg["bf16"].update(
        bf16_master_weights_and_grads=True, bf16_optimizer_states=states, master_rounding=rounding
    )
    return cfg


def train(stage, gas, offload=False, rounding="nearest", states=True):
    world = dist.get_world_size()
    config = bf16_config(stage, gas, world, offload, rounding, states)
    return train_edge_engine(config, STEPS, gas, PARITY_LR)


def same_math(rounding="nearest", states=True):
    """The mode's own arithmetic on one process: zengine's bf16 Adam over the whole bf16 model."""
    from zengine.ops import CPUAdam

    return lambda groups: CPUAdam(
        groups, lr=PARITY_LR, fp32_optimizer_states=not states, rounding=rounding
    )


def movement_error(stage, gas, offload=False, rounding="nearest", states=True, reference="torch"):
    """(error relative to the reference's movement, the movement, worst relative loss error,
    kinds). ``reference``: "torch" (AdamW on bf16 parameters) or "same" (``same_math``)."""
    losses, params, init, batches, kinds = train(stage, gas, offload, rounding, states)
    ref_model = copy.deepcopy(init).to(torch.bfloat16)
    ref_losses, ref_params = reference_run(
        ref_model,
        batches,
        PARITY_LR,
        PARITY_CLIP,
        make_optimizer=same_math(rounding, states) if reference == "same" else None,
    )
    start = {n: p.detach().float() for n, p in ref_model.named_parameters()}
    moved = sum(((ref_params[n].float() - start[n]) ** 2).sum() for n in ref_params).sqrt().item()
    off = sum(((params[n] - ref_params[n].float()) ** 2).sum() for n in ref_params).sqrt().item()
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return off / moved, moved, loss_err, kinds


def check(cases):
    """Each case's movement error and loss error within its reference's bounds; returns them."""
    out = []
    for case in cases:
        reference = case[5] if len(case) > 5 else "torch"
        off, moved, loss_err, kinds = movement_error(*case)
        move_tol, loss_tol = BOUNDS[reference]
        if len(case) > 3 and case[3] == "stochastic":
            move_tol *= 2  # the reference draws other bits (one shard, not W): measured 0.12 at W=3
        assert moved > 0.5, f"{case}: the reference moved only {moved:.3g}: the test could not fail"
        assert off <= move_tol, f"{case}: off by {off:.3g} of the movement"
        assert loss_err <= loss_tol, f"{case}: loss off by {loss_err:.3g}"
        states = "torch.float32" if len(case) > 4 and not case[4] else "torch.bfloat16"
        assert kinds["states"] == [states] and kinds["masters"] == ["torch.bfloat16"], kinds
        assert kinds["class"] == "CPUAdam", kinds
        out.append((off, loss_err))
    return out


# Against torch AdamW on bf16 parameters, which rounds every operation to bf16 (moments, the
# update), zengine's one rounding per element lands within 18% of the movement after 6 steps
# (measured 0.15-0.18 at W=1-3); against the mode's own arithmetic on one process (clipping in
# the reference's bf16 norm and the bf16 gradient sums differ), within 6% (0.015-0.062 at W=3).
BOUNDS = {"torch": (0.25, 0.03), "same": (0.1, 0.015)}

CASES = (
    [(s, g) for s in (1, 2, 3) for g in (1, 2)]
    + [(s, g, False, "nearest", True, "same") for s, g in ((1, 1), (2, 2), (3, 1))]
    + [(2, 1, False, "kahan", True, "same"), (3, 2, False, "stochastic", True, "same")]
)


# at four ranks (two "nodes" of the harness's machine) the stages with accumulation, and stochastic
# rounding (its draws depend on the shard layout), to keep the suite's time; one rank runs them all
CASES_BY_WORLD = {
    1: CASES,
    2: CASES,
    3: CASES,
    4: [(1, 2), (2, 2), (3, 2), (3, 2, False, "stochastic", True, "same")],
}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bf16_masters_match_torch_adamw_on_bf16_parameters(world):
    spawn(check, world, CASES_BY_WORLD[world])


OFFLOAD_CASES = [
    (1, 1, True, "nearest", True, "same"),
    (2, 2, True, "nearest", True, "same"),
    (3, 1, True, "nearest", True, "same"),
    (3, 2, "param", "nearest", True, "same"),
    (3, 1, "param-nvme", "nearest", True, "same"),  # parameter shards in a swap file
    (
        2,
        1,
        True,
        "nearest",
        False,
        "same",
    ),  # fp32 moments over bf16 masters (DeepSpeed's offload mode)
    (3, 1, False, "nearest", False, "same"),
]


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_masters_with_cpu_offload(world):
    spawn(check, world, OFFLOAD_CASES)


def _memory(stage, offload):
    """Bytes per owned element of the optimizer's states and whether the masters are the
    parameter shards' own storage."""
    world = dist.get_world_size()
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=bf16_config(stage, 1, world, offload),
        model_parameters=edge_param_groups(model, PARITY_LR),
    )
    train_global_batch(engine, make_batches(1, PARITY_MICRO * world)[0], PARITY_MICRO, 1)
    opt = engine.optimizer
    owned = sum(m.numel() for m in opt.masters)
    state = sum(t.nbytes for s in opt.optimizer.state.values() for t in s.values() if t.dim())
    shared = [m.data_ptr() == g.owned_params().data_ptr() for m, g in zip(opt.masters, opt.groups)]
    return state / owned, all(shared), engine.memory_breakdown()


def test_eight_bytes_per_parameter():
    for stage in (1, 2, 3):
        for per_elem, shared, breakdown in spawn(_memory, 2, stage, False):
            assert per_elem == 4.0  # two bf16 moments
            assert shared  # the bf16 parameter shard is the master: no copy


def _refused(cfg_bf16, zero=None, optimizer=None):
    world = dist.get_world_size()
    cfg = parity_config(2, "bf16", 1, world)
    cfg["bf16"].update(cfg_bf16)
    cfg["zero_optimization"].update(zero or {})
    if optimizer:
        cfg["optimizer"] = optimizer
    model = EdgeNet()
    try:
        zengine.initialize(model=model, config=cfg, model_parameters=model.parameters())
    except (ValueError, zengine.config.ConfigError) as err:
        return str(err)
    return None


REFUSALS = [
    ({"bf16_optimizer_states": True}, None, None, "needs bf16.bf16_master_weights_and_grads"),
    ({"master_rounding": "kahan"}, None, None, "enable bf16.bf16_master_weights_and_grads"),
    ({**MASTERS}, {"stage": 0}, None, "stages 1-3"),
    (
        {"bf16_master_weights_and_grads": True},
        None,
        {"type": "SGD", "params": {"lr": 0.1}},
        "keeps its states in the parameters' dtype",
    ),
    (
        {**MASTERS, "master_rounding": "stochastic"},
        None,
        {"type": "SGD", "params": {"lr": 0.1}},
        "needs optimizer type Adam",
    ),
]


@pytest.mark.parametrize("bf16,zero,optimizer,message", REFUSALS)
def test_refused_by_name_on_every_rank(bf16, zero, optimizer, message):
    for text in spawn(_refused, 2, bf16, zero, optimizer):
        assert text is not None and message in text, text


PEAK_LAYERS, PEAK_WIDTH = 8, 1536  # 18.9M parameters: states dominate the rank's memory
PEAK_PSI = PEAK_LAYERS * PEAK_WIDTH * PEAK_WIDTH


def _own_memory() -> tuple[int, int]:
    """This process's anonymous resident bytes now and its high-water mark less the shared pages."""
    with open("/proc/self/status") as f:
        status = {
            k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in f) if "kB" in v
        }
    return status["RssAnon"], status["VmHWM"] - status["RssFile"] - status["RssShmem"]


def _peak_config(stage: int, low: bool, precision: str = "bf16") -> dict:
    bucket = PEAK_PSI // 16
    zero = dict(reduce_bucket_size=bucket, allgather_bucket_size=bucket, overlap_comm=False)
    if stage == 3:  # one layer gathered at a time, no prefetch
        zero.update(stage3_max_live_parameters=bucket, **NO_PREFETCH)
    cfg = ds_config(stage, precision, lr=1e-4, zero=zero)
    if low:  # fp16's counterpart (fp16_master_weights_and_grads) keeps fp32 moments
        cfg[precision].update(MASTERS if precision == "bf16" else FP16_MASTERS)
    return cfg


def _peak(stage: int, low: bool, precision: str = "bf16") -> tuple[float, float]:
    """(peak over three steps, model-state bytes counted) per parameter, from a baseline taken
    after torch's lazy imports, bf16 compute, fp32 or bf16 masters."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # freed large blocks go back to the system
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts here
    base, _ = _own_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(PEAK_WIDTH, PEAK_WIDTH, bias=False) for _ in range(PEAK_LAYERS)]
    )
    cfg = _peak_config(stage, low, precision)
    engine, *_ = zengine.initialize(model=model, config=cfg, model_parameters=model.parameters())
    del model  # (the engine holds it)
    _, start_peak = _own_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the steps' high-water mark: the model built in fp32 is not the mode's
    for _ in range(3):
        x = torch.randn(2, PEAK_WIDTH).to(engine.config.compute_dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    _, peak = _own_memory()
    from zengine.engine.engine import model_state_bytes

    counted = model_state_bytes(engine.memory_breakdown()) / PEAK_PSI
    return (peak - base) / PEAK_PSI, counted, (start_peak - base) / PEAK_PSI


@pytest.mark.parametrize("stage", [2, 3])
def test_peak_memory_against_fp32_masters(stage):
    """The process high-water mark over three steps, per parameter, W=2: bf16 compute keeps
    2 + (4 + 4 + 8)/2 = 10 bytes at stage 2 with fp32 masters, 2 + (2 + 4)/2 = 5 with bf16
    masters and moments (stage 3: 16/2 = 8, its fp32 shard being the master, against 8/2 = 4);
    the estimator says the same."""
    from zengine.estimate import estimate

    peaks = {}
    for low in (False, True):
        (peak, counted, start), _ = spawn(_peak, 2, stage, low, start="spawn")
        peaks[low] = peak
        predicted = (
            estimate(PEAK_PSI, _peak_config(stage, low), 2, cpu_training=True).device_states
            / PEAK_PSI
        )
        expected = {(2, False): 10, (2, True): 5, (3, False): 8, (3, True): 4}[stage, low]
        assert counted == pytest.approx(expected, abs=0.1), (low, counted)
        assert predicted == pytest.approx(expected, abs=0.1), (low, predicted)
        # plus a step's transients (autograd's gradient of a layer, buckets): measured 10.6 and
        # 5.4 bytes/param at stage 2
        assert peak <= expected * 1.1 + 1.0, (low, peak)
    saving = 1 - peaks[True] / peaks[False]
    assert saving >= 0.4, f"stage {stage}: peak {peaks[False]:.2f} -> {peaks[True]:.2f} bytes/param"


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_masters_peak_memory(stage):
    """fp16's counterpart (fp16.fp16_master_weights_and_grads: fp16 masters and gradients, fp32
    moments), W=2: 2 + (4 + 4 + 8)/2 = 10 bytes at stage 2 with fp32 masters against
    2 + (2 + 8)/2 = 7 (stage 3: 16/2 = 8, its fp32 shard being the master, against 12/2 = 6);
    the estimator says the same. Measured peaks: 11.05 -> 8.05 bytes/param at stage 2, 10.09 ->
    7.09 at stage 3 when its shard was fp16 beside an fp32 master."""
    from zengine.estimate import estimate

    peaks = {}
    for low in (False, True):
        (peak, counted, _), _ = spawn(_peak, 2, stage, low, "fp16", start="spawn")
        peaks[low] = peak
        cfg = _peak_config(stage, low, "fp16")
        predicted = estimate(PEAK_PSI, cfg, 2, cpu_training=True).device_states / PEAK_PSI
        expected = {(2, False): 10, (2, True): 7, (3, False): 8, (3, True): 6}[stage, low]
        assert counted == pytest.approx(expected, abs=0.1), (low, counted)
        assert predicted == pytest.approx(expected, abs=0.1), (low, predicted)
        assert peak <= expected * 1.1 + 1.0, (low, peak)
    saving = 1 - peaks[True] / peaks[False]
    states_saving = {2: 1 - 7 / 10, 3: 1 - 6 / 8}[stage]  # diluted by the step's transients
    assert saving >= 0.7 * states_saving, (
        f"stage {stage}: peak {peaks[False]:.2f} -> {peaks[True]:.2f} bytes/param"
    )
