"""Where the mean over ranks is taken, and in what dtype the sum runs: DeepSpeed's
``gradient_predivide_factor`` (divide by f before the reduction, by world / f after, in the reduce
dtype), ``prescale_gradients`` (divide by the world before), ``fp32_allreduce`` (16-bit gradients
summed in fp32) (``zero/grad_dtypes.ReduceScaling``, ``zero/reducer.WireCodec``).

In fp16 each of these rounds differently: the reference is one process that computes each rank's
fp16 micro-batch gradient and sums them with the very arithmetic the stage runs (the same fp16
multiplications, the ranks' sum in rank order, at the boundary at stages 0-1 and per micro-step at
2-3), then SGD on fp32 masters. Every bucket goes through the shared-memory transport, which sums in
rank order. And an fp16 sum that overflows without the predivision does not with it.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import SHARD_ALL, ds_config, sgd
from harness import spawn
from zengine.config import ConfigError, load_config
from zengine.distributed import shm
from zengine.zero.grad_dtypes import GradDtypes, ReduceScaling

STEPS, MICRO, DIM, LR = 3, 2, 24, 1e-2
SCALE = 2.0**8  # static fp16 loss scale (a power of two: the unscale is exact)

MODES = {  # name -> top-level keys
    "plain": {},
    "predivide": {"gradient_predivide_factor": 2.0},
    "predivide3": {"gradient_predivide_factor": 3.0},
    "prescale": {"prescale_gradients": True},
    "fp32_allreduce": {"fp32_allreduce": True},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))


def _batches(world: int, gas: int) -> list:
    g = torch.Generator().manual_seed(1)
    n = MICRO * gas * world
    # targets far from the outputs: every rank's gradient has about the same large values
    return [
        (torch.randn(n, DIM, generator=g), 4 + torch.randn(n, DIM, generator=g))
        for _ in range(STEPS)
    ]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _config(stage: int, gas: int, mode: str, scale: float = SCALE) -> dict:
    return ds_config(
        stage,
        "fp16",
        micro_batch=MICRO,
        gas=gas,
        optimizer=sgd(LR),
        steps_per_print=10**6,
        zero={"reduce_bucket_size": 300, **SHARD_ALL},
        fp16={"loss_scale": scale},
        shared_memory={"enabled": True, "piece_size": 1 << 16},
        **MODES[mode],
    )


def _train(stage: int, gas: int, mode: str, scale: float = SCALE) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    shm.MIN_BYTES = 0  # (this worker's) every bucket through shared memory: rank-order sums
    engine, *_ = zengine.initialize(model=_model(), config=_config(stage, gas, mode, scale))
    for x, y in _batches(world, gas):
        for m in range(gas):
            rows = slice((m * world + rank) * MICRO, (m * world + rank + 1) * MICRO)
            engine.backward(_loss(engine(x[rows]), y[rows]))
            engine.step()
    masters = [
        zengine.utils.safe_get_full_fp32_param(p).tolist() for p in engine.module.parameters()
    ]
    skipped = engine.skipped_steps
    engine.destroy()
    return masters, skipped


def _train_all(cases: list) -> list:
    return [_train(*case) for case in cases]


def _reduce(parts: list, mode: str, world: int, full: bool) -> torch.Tensor:
    """The ranks' fp16 gradients as the reduction leaves them: scaled, summed in rank order, in the
    wire dtype (fp16, fp32 under fp32_allreduce); returned in fp32 with the division by the world
    where the reduction did not take it: in the fp16 buffer at stages 0-1 (``full``: it holds the
    mean gradient, as torch's ``.grad``), in fp32 at 2-3."""
    keys = MODES[mode]
    wire = torch.float32 if keys.get("fp32_allreduce") else torch.float16
    scaling = ReduceScaling(**_scaling(keys, world))
    parts = [scaling.scale(p.to(wire).clone(), scaling.before) for p in parts]
    total = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    for p in parts[2:]:
        total.add_(p)
    total = scaling.scale(total, scaling.after)
    if scaling.in_reduce:
        return total.float()
    if full:  # the fp32 sum copied back into the fp16 buffer, divided there
        return (total.half() / world).float()
    return total.float() / world


def _scaling(keys: dict, world: int) -> dict:
    if keys.get("prescale_gradients"):
        return {"before": 1.0 / world, "in_reduce": True}
    f = keys.get("gradient_predivide_factor", 1.0)
    return {"before": 1.0 / f, "after": f / world, "in_reduce": True} if f != 1.0 else {}


def _reference(world: int, gas: int, stage: int, mode: str) -> list:
    """One process: fp32 masters, each rank's micro-batch backward on their fp16 copy (the loss times
    the scale over the accumulation steps, as the engine's fp16 backward), the sums as the stage runs
    them (``_reduce``), SGD on the masters."""
    masters = _model().half().float()  # the engine's masters start from the fp16 parameters
    model16 = _model().half()
    for x, y in _batches(world, gas):
        with torch.no_grad():
            for p16, p in zip(model16.parameters(), masters.parameters()):
                p16.copy_(p)
        grads = []  # [micro-step][rank] -> per-parameter fp16 gradients
        for m in range(gas):
            grads.append([])
            for r in range(world):
                rows = slice((m * world + r) * MICRO, (m * world + r + 1) * MICRO)
                model16.zero_grad()
                (_loss(model16(x[rows].half()), y[rows]) * (SCALE / gas)).backward()
                grads[m].append([p.grad.clone() for p in model16.parameters()])
        for i, p in enumerate(masters.parameters()):
            if stage <= 1:  # autograd sums the micro-steps in fp16, one reduction at the boundary
                local = [grads[0][r][i].clone() for r in range(world)]
                for m in range(1, gas):
                    for r in range(world):
                        local[r] += grads[m][r][i]
                total = _reduce(local, mode, world, True)
            else:  # a reduction per micro-step, summed into the fp32 shard
                total = sum(
                    _reduce([g[i] for g in grads[m]], mode, world, False) for m in range(gas)
                )
            p.grad = total * (1.0 / SCALE)
        with torch.no_grad():
            for p in masters.parameters():
                p -= LR * p.grad
    return [p.detach().clone() for p in masters.parameters()]


def _max_diff(a: list, b: list) -> float:
    return max((torch.as_tensor(x) - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 3])
def test_scaling_and_wire_match_the_same_arithmetic(world):
    cases = [
        (stage, gas, mode)
        for stage in (0, 1, 2, 3)
        for gas in (1, 2)
        for mode in MODES
        if (gas == 1 or mode in ("predivide", "prescale"))
    ]
    results = spawn(_train_all, world, cases)[0]
    for case, (masters, skipped) in zip(cases, results):
        stage, gas, mode = case
        ref = _reference(world, gas, stage, mode)
        plain = _reference(world, gas, stage, "plain")
        diff, effect = _max_diff(masters, ref), _max_diff(ref, plain)
        print(
            f"W={world} stage={stage} gas={gas} {mode}: max|diff| {diff:.2g} (vs plain {effect:.2g})"
        )
        assert skipped == 0 and diff < 1e-6, (case, diff)
        if mode == "predivide3":  # dividing by 3 rounds in fp16: the key shows in the numbers
            assert effect > 1e-6, (case, effect)


def _overflow_scale(world: int) -> float:
    """A loss scale under which each rank's fp16 gradient fits (5e4 at most) but the sum of the
    ranks' does not (the targets lead every rank's gradient the same way)."""
    model, largest = _model(), 0.0
    for x, y in _batches(world, 1):
        for r in range(world):
            model.zero_grad()
            _loss(model(x[r * MICRO : (r + 1) * MICRO]), y[r * MICRO : (r + 1) * MICRO]).backward()
            largest = max([largest] + [p.grad.abs().max().item() for p in model.parameters()])
    return 5e4 / largest


def test_predivision_keeps_an_fp16_sum_in_range():
    world = 3
    scale = _overflow_scale(world)
    cases = [
        (stage, 1, mode, scale)
        for stage in (0, 2, 3)
        for mode in ("plain", "predivide3", "prescale")
    ]
    results = spawn(_train_all, world, cases)[0]
    for (stage, _, mode, _), (masters, skipped) in zip(cases, results):
        print(f"stage {stage} {mode}: skipped {skipped} of {STEPS}")
        # summed as they are, three ranks' gradients overflow fp16; divided first, never
        assert (skipped >= 1) if mode == "plain" else (skipped == 0), (stage, mode, skipped)


def test_config_keys():
    def load(**keys):
        return load_config(
            {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}, **keys}, 4
        )

    assert GradDtypes.from_config(load(fp32_allreduce=True)).reduce == torch.float32
    assert GradDtypes.from_config(load()).reduce == torch.float16
    assert GradDtypes.from_config(
        load(gradient_predivide_factor=2.0), world=4
    ).scaling == ReduceScaling(0.5, 0.5, True)
    assert GradDtypes.from_config(load(prescale_gradients=True), world=4).scaling == ReduceScaling(
        0.25, 1.0, True
    )
    for keys, words in [
        ({"fp32_allreduce": True, "communication_data_type": "bf16"}, "fp32_allreduce: true asks"),
        ({"prescale_gradients": True, "gradient_predivide_factor": 2.0}, "ignores the factor"),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor"),
        ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16 masters need fp16 compute"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load(**keys)


class _Scaled(nn.Module):
    """A linear layer times a float buffer (1/3: not a bf16 value)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(DIM, DIM)
        self.register_buffer("gain", torch.full((DIM,), 1.0 / 3.0))

    def forward(self, x):
        return self.linear(x) * self.gain


def _buffer_forward(buffer_dtype) -> tuple:
    keys = {"data_types": {"buffer_dtype": buffer_dtype}} if buffer_dtype else {}
    cfg = ds_config(3, "bf16", micro_batch=MICRO, optimizer=sgd(LR), **keys)
    engine, *_ = zengine.initialize(model=_Scaled(), config=cfg)
    x = _batches(dist.get_world_size(), 1)[0][0][:MICRO]
    out = engine(x).float().tolist()
    dtype = str(engine.module.gain.dtype)
    engine.destroy()
    return dtype, out


def _buffer_runs() -> list:
    return [_buffer_forward(d) for d in (None, "fp32")]


def test_buffer_dtype():
    (plain_dtype, plain), (kept_dtype, kept) = spawn(_buffer_runs, 2)[0]
    assert plain_dtype == "torch.bfloat16" and kept_dtype == "torch.float32"
    x = _batches(2, 1)[0][0][:MICRO].bfloat16()
    kept_model = _Scaled()
    kept_model.linear.bfloat16()  # the parameters in bf16, the buffer left in fp32
    with torch.no_grad():
        as_bf16 = _Scaled().bfloat16()(x).float()
        as_fp32 = kept_model(x).float()
    assert torch.equal(torch.tensor(plain), as_bf16) and torch.equal(torch.tensor(kept), as_fp32)
    assert not torch.equal(as_bf16, as_fp32)  # the buffer's dtype shows in the numbers
