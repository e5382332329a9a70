"""DeepSpeed's ``torch_autocast`` section (``zengine/precision/autocast.py``): fp32 parameters and
masters, the forward under ``torch.autocast``, the gradients of ``nn.Linear`` (the default
lower-precision-safe modules) reduced in the autocast dtype and the rest in fp32 at stages 1-3,
every gradient in fp32 at stage 0.

Against torch's own autocast on one process (same model, global batch, AdamW) after several steps,
at W=2 and 3, stages 0-3, one and two micro-steps; and the dtypes each bucket crossed the ranks in.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import SHARD_ALL, adamw, ds_config
from harness import spawn
from zengine.config import ConfigError, load_config
from zengine.distributed import collectives, shm

# Adam's eps well above the rounding of the gradients: its first steps are otherwise nearly sign
# descent, which turns a rounding difference in a gradient near zero into a whole step
STEPS, MICRO, DIM, LR, EPS = 4, 2, 16, 1e-2, 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, 2 * DIM), nn.LayerNorm(2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)
    )


def _batches(world: int, gas: int) -> list:
    g = torch.Generator().manual_seed(1)
    n = MICRO * gas * world
    # targets far from the outputs: every gradient component is far from zero, where Adam's first
    # steps (nearly sign descent) would turn a rounding difference into a whole step
    return [
        (torch.randn(n, DIM, generator=g), 4 + torch.randn(n, DIM, generator=g))
        for _ in range(STEPS)
    ]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _rank_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> list:
    """The gradient of one rank's micro-batch, as its backward leaves it (fp32 ``.grad``)."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    _loss(out, y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _wire_sum(grads: list, dtype: torch.dtype) -> torch.Tensor:
    """The ranks' gradients summed as a reduction in ``dtype`` sums them (rounding at each add)."""
    total = grads[0].to(dtype)
    for g in grads[1:]:
        total = total + g.to(dtype)
    return total.float()


def _reference(world: int, gas: int, stage: int, autocast: bool = True, wire: bool = True) -> list:
    """One process, torch AdamW on the global batch, each rank's micro-batch a backward of its own
    under torch.autocast (bf16), the gradients summed as the stage sums them: over micro-steps in
    fp32, over ranks in bf16 for the Linear layers at stages 1-3 (``wire``; else in fp32), once per
    step at stages 0-1 and per micro-step at 2-3; the mean taken in fp32 at the step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    lower = {id(p) for m in model.modules() if type(m) is nn.Linear for p in m.parameters()}
    dtypes = [
        torch.bfloat16 if wire and stage >= 1 and id(p) in lower else torch.float32
        for p in model.parameters()
    ]
    for x, y in _batches(world, gas):
        grads = [[] for _ in range(gas)]  # [micro-step][rank] -> per-parameter gradients
        for m in range(gas):
            for r in range(world):
                rows = slice((m * world + r) * MICRO, (m * world + r + 1) * MICRO)
                grads[m].append(_rank_grads(model, x[rows], y[rows], autocast))
        for i, p in enumerate(model.parameters()):
            if stage <= 1:  # each rank's micro-steps summed locally, one reduction at the boundary
                local = [sum(grads[m][r][i] for m in range(gas)) for r in range(world)]
                total = _wire_sum(local, dtypes[i])
            else:  # a reduction per micro-step, summed into the fp32 shard
                total = sum(_wire_sum([g[i] for g in grads[m]], dtypes[i]) for m in range(gas))
            p.grad = total / (world * gas)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _config(stage: int, gas: int, **extra) -> dict:
    return ds_config(
        stage,
        micro_batch=MICRO,
        gas=gas,
        optimizer=adamw(LR, eps=EPS, weight_decay=0.01),
        steps_per_print=10**6,
        zero={"reduce_bucket_size": 200, **SHARD_ALL},
        torch_autocast={"enabled": True, "dtype": "bf16"},
        # sums in rank order, what the reference repeats (gloo's order varies along a buffer at W=3)
        shared_memory={"enabled": True, "piece_size": 1 << 16},
        **extra,
    )


def _recording(wires: list):
    """Wrap the gradient collectives so that each call notes the dtype it moved."""
    for name in ("all_reduce_sum", "reduce_scatter_rows", "reduce_to_owners"):
        inner = getattr(collectives, name)

        def note(buf, *args, _inner=inner, **kwargs):
            wires.append(buf.dtype)
            return _inner(buf, *args, **kwargs)

        setattr(collectives, name, note)


def _train(stage: int, gas: int) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    shm.MIN_BYTES = 0  # (this worker's) every bucket through shared memory, however small
    engine, *_ = zengine.initialize(model=_model(), config=_config(stage, gas))
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    wires: list = []
    _recording(wires)
    for x, y in _batches(world, gas):
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            out = engine(x[rows])
            assert out.dtype == torch.bfloat16  # the last Linear ran under autocast
            engine.backward(_loss(out, y[rows]))
            engine.step()
    masters = [
        zengine.utils.safe_get_full_fp32_param(p).tolist() for p in engine.module.parameters()
    ]
    engine.destroy()
    # (float64: the step's all-reduce of control values, not a gradient)
    return masters, sorted({str(d) for d in wires if d != torch.float64})


def _train_all(cases: list) -> list:
    return [_train(*case) for case in cases]


def _max_diff(a: list, b: list) -> float:
    return max((torch.as_tensor(x) - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 3])
def test_autocast_matches_torch_autocast(world):
    cases = [(stage, gas) for stage in (0, 1, 2, 3) for gas in (1, 2)]
    results = spawn(_train_all, world, cases)[0]
    start = list(_model().parameters())
    for stage, gas in cases:
        masters, wires = results[cases.index((stage, gas))]
        ref = _reference(world, gas, stage)
        assert _max_diff(ref, start) > 2 * LR  # the reference moved
        # what the test can tell apart: the forward in fp32, the Linear gradients summed in fp32
        fp32 = _max_diff(ref, _reference(world, gas, stage, autocast=False))
        fp32_sum = _max_diff(ref, _reference(world, gas, stage, wire=False))
        diff = _max_diff(masters, ref)
        print(
            f"W={world} stage={stage} gas={gas}: max|diff| {diff:.2g}; reference vs fp32 forward "
            f"{fp32:.2g}, vs fp32 sums {fp32_sum:.2g}; wires {wires}"
        )
        assert fp32 > 1e-4, (stage, gas, fp32)
        assert diff < 1e-6, (stage, gas, diff)  # the same arithmetic, up to fp32 rounding
        if stage >= 1:  # the Linear gradients were summed in bf16, not fp32
            assert fp32_sum > 1e-5, (stage, gas, fp32_sum)
        expected = ["torch.float32"] if stage == 0 else ["torch.bfloat16", "torch.float32"]
        assert wires == expected, (stage, wires)


def test_refused_combinations():
    base = {"train_micro_batch_size_per_gpu": 1, "torch_autocast": {"enabled": True}}
    for extra, words in [
        ({"bf16": {"enabled": True}}, "bf16 is enabled too"),
        ({"fp16": {"enabled": True}}, "fp16 is enabled too"),
        (
            {"communication_data_type": "fp32", "zero_optimization": {"stage": 2}},
            "communication_data_type is set at stage 2",
        ),
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "zero_quantized_weights is on",
        ),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config({**base, **extra}, 1)
    with pytest.raises(ConfigError, match="fp32 is not an autocast dtype"):
        load_config({**base, "torch_autocast": {"enabled": True, "dtype": "fp32"}}, 1)
    # stage 0: DeepSpeed reduces every gradient in communication_data_type there
    load_config({**base, "communication_data_type": "fp32", "zero_optimization": {"stage": 0}}, 1)


def test_safe_modules_choose_the_wire_dtypes():
    from zengine.precision.autocast import forward_precision

    model = _model()
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "torch_autocast": {
                "enabled": True,
                "lower_precision_safe_modules": ["torch.nn.LayerNorm"],
            },
        },
        1,
    )
    wires = forward_precision(cfg.torch_autocast, torch.device("cpu"), 2).wire_dtypes(model)
    assert wires == {id(p): torch.bfloat16 for p in model[1].parameters()}  # CPU default: bf16
    assert forward_precision(cfg.torch_autocast, torch.device("cpu"), 0).wire_dtypes(model) == {}
    bad = cfg.torch_autocast.model_copy(update={"lower_precision_safe_modules": ["torch.nn.Nope"]})
    with pytest.raises(ValueError, match="cannot import 'torch.nn.Nope'"):
        forward_precision(bad, torch.device("cpu"), 2)


# -- fp16 autocast: the loss scaled as torch's GradScaler scales it -----------------------------------
FP16_STEPS = 8


def _fp16_batches(world: int) -> list:
    g = torch.Generator().manual_seed(2)
    n = MICRO * world
    # targets far from the outputs, gradients of several units: at GradScaler's 2**16 the fp16
    # backward overflows, so the first steps are skipped and the scale halves until it fits
    return [
        (torch.randn(n, DIM, generator=g), 4 + torch.randn(n, DIM, generator=g))
        for _ in range(FP16_STEPS)
    ]


def _train_fp16(stage: int) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    shm.MIN_BYTES = 0
    cfg = _config(stage, 1)
    cfg["torch_autocast"] = {"enabled": True, "dtype": "fp16"}
    engine, *_ = zengine.initialize(model=_model(), config=cfg)
    for x, y in _fp16_batches(world):
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        out = engine(x[rows])
        assert out.dtype == torch.float16
        engine.backward(_loss(out, y[rows]))
        engine.step()
    masters = [
        zengine.utils.safe_get_full_fp32_param(p).tolist() for p in engine.module.parameters()
    ]
    result = masters, engine.skipped_steps, engine.loss_scale
    engine.destroy()
    return result


def _train_fp16_all(stages: list) -> list:
    return [_train_fp16(stage) for stage in stages]


def _fp16_reference(world: int, stage: int) -> tuple:
    """One process: each rank's micro-batch under torch.autocast(fp16) with its loss times the scale,
    the Linear gradients summed in fp16 (stages 1-3), the rest in fp32; a non-finite sum skips the
    step and halves the scale (GradScaler's policy: init 2**16, backoff 0.5), else AdamW on the
    unscaled mean."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    lower = {id(p) for m in model.modules() if type(m) is nn.Linear for p in m.parameters()}
    dtypes = [
        torch.float16 if stage >= 1 and id(p) in lower else torch.float32
        for p in model.parameters()
    ]
    scale, skipped = 2.0**16, 0
    for x, y in _fp16_batches(world):
        grads = []
        for r in range(world):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[r * MICRO : (r + 1) * MICRO])
            (_loss(out, y[r * MICRO : (r + 1) * MICRO]) * scale).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        totals = [_wire_sum([g[i] for g in grads], d) for i, d in enumerate(dtypes)]
        if not all(torch.isfinite(t).all() for t in totals):
            scale, skipped = scale / 2, skipped + 1
            continue
        for p, t in zip(model.parameters(), totals):
            p.grad = t * (1.0 / (world * scale))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], skipped, scale


def test_fp16_autocast_scales_as_grad_scaler():
    world, stages = 2, [0, 1, 2, 3]
    results = spawn(_train_fp16_all, world, stages)[0]
    for stage, (masters, skipped, scale) in zip(stages, results):
        ref, ref_skipped, ref_scale = _fp16_reference(world, stage)
        diff = _max_diff(masters, ref)
        print(
            f"fp16 W={world} stage={stage}: max|diff| {diff:.2g}, skipped {skipped}, scale {scale}"
        )
        assert 0 < skipped == ref_skipped < FP16_STEPS and scale == ref_scale, (stage, skipped)
        assert diff < 1e-6, (stage, diff)


def _train_offloaded(stage: int) -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    shm.MIN_BYTES = 0
    cfg = _config(stage, 2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, *_ = zengine.initialize(model=_model(), config=cfg)
    for x, y in _batches(world, 2):
        for m in range(2):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            engine.backward(_loss(engine(x[rows]), y[rows]))
            engine.step()
    masters = [
        zengine.utils.safe_get_full_fp32_param(p).tolist() for p in engine.module.parameters()
    ]
    engine.destroy()
    return masters


def _train_offloaded_all(stages: list) -> list:
    return [_train_offloaded(stage) for stage in stages]


def test_autocast_with_cpu_offload():
    """The bf16 pieces land in the fp32 host shards the CPU Adam kernel steps on."""
    stages = [2, 3]
    for stage, masters in zip(stages, spawn(_train_offloaded_all, 2, stages)[0]):
        ref = _reference(2, 2, stage)
        diff, fp32_sum = (
            _max_diff(masters, ref),
            _max_diff(ref, _reference(2, 2, stage, wire=False)),
        )
        print(
            f"offload W=2 stage={stage} gas=2: max|diff| {diff:.2g} (vs fp32 sums {fp32_sum:.2g})"
        )
        # measured 1.2e-7 (the kernel's Adam arithmetic against torch's), fp32 sums 2.7e-4 away
        assert diff < fp32_sum / 5, (stage, diff, fp32_sum)


def _outer_autocast() -> list:
    """engine(...) called inside the script's own torch.autocast(bf16): the output dtypes."""
    x = torch.randn(MICRO, DIM)
    dtypes = []
    for section in (None, {"enabled": True, "dtype": "fp16"}):
        cfg = ds_config(0, micro_batch=MICRO, optimizer=adamw(LR), steps_per_print=10**6)
        if section:
            cfg["torch_autocast"] = section
        engine, *_ = zengine.initialize(model=_model(), config=cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes.append(str(engine(x).dtype))
        engine.destroy()
    return dtypes


def test_the_config_decides_over_an_outer_autocast():
    """DeepSpeed's rule: an autocast around the engine is off inside it when torch_autocast is
    off, and replaced by the section's when on."""
    assert spawn(_outer_autocast, 1)[0] == ["torch.float32", "torch.float16"]
