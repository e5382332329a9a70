"""The dtypes gradients are reduced across ranks and accumulated over micro-steps in: DeepSpeed's
``communication_data_type`` and ``data_types.grad_accum_dtype`` (``zengine/zero/grad_dtypes.py``).

Against a single-process fp32 torch reference at W=4 with 2 micro-steps, 16-bit compute: summing in
fp32 is measurably closer to the reference than summing in bf16 (each rank's bf16 addition rounds), and
an fp16 sum of four ranks' gradients that overflows fp16 is no overflow in fp32.

The model is chosen so that the sums are what differs: its initial weights and inputs are exact in bf16
(so the 16-bit copy of the weights and the cast inputs equal the reference's), the targets are far from
the outputs (so the gradient barely depends on the rounded activations), and SGD passes gradient errors
on to the weights as they are (Adam's first steps are nearly sign descent, which hides them).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
from configs import SHARD_ALL, ds_config, sgd
from harness import spawn
from zengine.config import ConfigError, load_config
from zengine.estimate import estimate
from zengine.zero.grad_dtypes import GradDtypes

WORLD, GAS, MICRO, STEPS, DIM, LR = 4, 2, 4, 4, 32, 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(DIM, DIM)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                p.bfloat16().float()
            )  # exact in bf16 and fp16: the engine's 16-bit copy is the reference's
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = MICRO * GAS * WORLD
    # inputs exact in bf16 (the engine casts them), targets far from the outputs: the gradient is led by them
    return [
        (torch.randn(n, DIM, generator=g).bfloat16().float(), 4 + torch.randn(n, DIM, generator=g))
        for _ in range(STEPS)
    ]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _reference() -> list[torch.Tensor]:
    """Plain fp32 torch on each global batch: the parameters after the steps."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _batches():
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _config(stage: int, precision: str, comm=None, accum=None, loss_scale=0.0) -> dict:
    extra = {}
    if precision == "fp16":
        extra["fp16"] = {"loss_scale": loss_scale}
    if comm is not None:
        extra["communication_data_type"] = comm
    if accum is not None:
        extra["data_types"] = {"grad_accum_dtype": accum}
    # several buckets per step; stage 3 shards every parameter
    return ds_config(
        stage,
        precision,
        micro_batch=MICRO,
        gas=GAS,
        steps_per_print=10**6,
        optimizer=sgd(LR),
        zero={"reduce_bucket_size": 300, **SHARD_ALL},
        **extra,
    )


def _train(case: tuple) -> tuple[list, int]:
    """This rank's run of ``case`` (``_config``'s arguments): the fp32 masters after the steps (as lists:
    tensors would go back through shared memory the exiting worker takes with it) and the skipped steps."""
    rank = dist.get_rank()
    engine, *_ = zengine.initialize(model=_model(), config=_config(*case))
    for x, y in _batches():
        for m in range(GAS):
            rows = slice((m * WORLD + rank) * MICRO, (m * WORLD + rank + 1) * MICRO)
            engine.backward(_loss(engine(x[rows]), y[rows]))
            engine.step()
    masters = [
        zengine.utils.safe_get_full_fp32_param(p).tolist() for p in engine.module.parameters()
    ]
    return masters, engine.skipped_steps


def _train_all(cases: list) -> list:
    return [_train(case) for case in cases]


def _fp16_scale() -> float:
    """A static loss scale under which each rank's scaled micro-step gradient fits fp16 (about 2e4 at most)
    while the sum of the four does not (about 8e4 > 65504)."""
    model = _model()
    x, y = _batches()[0]
    _loss(
        model(x), y
    ).backward()  # each rank's micro-batch gradient is about the global one: the targets lead
    largest = max(p.grad.abs().max().item() for p in model.parameters())
    return 2e4 * GAS / largest  # fp16 backward runs on loss * scale / GAS, as DeepSpeed's


# bf16: summed in bf16 (reduction and accumulation), the defaults (bf16 reduction, fp32 shard), all fp32
BF16 = {"bf16": ("bf16", "bf16"), "default": (None, None), "fp32": ("fp32", "fp32")}


def test_fp32_reduction_is_closer_to_the_fp32_reference():
    scale = _fp16_scale()
    cases = [(stage, "bf16", *dtypes) for stage in (2, 3) for dtypes in BF16.values()]
    cases += [(stage, "fp16", comm, None, scale) for stage in (2, 3) for comm in ("fp16", "fp32")]
    cases += [
        (1, "bf16", "fp32", None),
        (1, "bf16", "fp32", "fp32"),
    ]  # stage 1: converted buckets; fp32 sum
    results = spawn(_train_all, WORLD, cases)[0]
    ref, start = _reference(), list(_model().parameters())
    moved = sum(((r - s) ** 2).sum() for r, s in zip(ref, start)).sqrt().item()
    assert moved > 0.05, f"the reference moved only {moved:.3g}: the test could not fail"
    error, skipped = {}, {}
    for case, (masters, skips) in zip(cases, results):
        off = sum(((torch.tensor(m) - r) ** 2).sum() for m, r in zip(masters, ref)).sqrt().item()
        error[case], skipped[case] = off / moved, skips  # of the reference's movement
    report = ", ".join(f"{c[:4]}: {e:.3g}" for c, e in error.items())
    for stage in (2, 3):
        bf16, default, fp32 = (error[(stage, "bf16", *dtypes)] for dtypes in BF16.values())
        # measured (stage 2 and 3 alike): 2.6e-3 summed in bf16, 2.1e-3 by default, 1.2e-3 in fp32
        assert bf16 < 5e-3 and fp32 < 2e-3, report
        assert fp32 * 1.5 < bf16 and fp32 < default < bf16, report
        fp16_sum, fp32_sum = (
            (stage, "fp16", "fp16", None, scale),
            (stage, "fp16", "fp32", None, scale),
        )
        # four ranks' fp16 gradients overflow their fp16 sum: every step is skipped, nothing moves
        assert skipped[fp16_sum] == STEPS and error[fp16_sum] == pytest.approx(1.0, abs=1e-6), (
            report
        )
        assert skipped[fp32_sum] == 0 and error[fp32_sum] < 1e-3, (
            report
        )  # summed in fp32: no overflow
    # stage 1: buckets reduced as fp32 copies of the bf16 buffer; summed in fp32 throughout
    converted, full = error[(1, "bf16", "fp32", None)], error[(1, "bf16", "fp32", "fp32")]
    assert converted < 5e-3 and full < 2e-3 and full < converted, report


def test_defaults_follow_deepspeed_and_fsdp2():
    def dtypes(stage, precision="bf16", **keys):
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, **keys}
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        return GradDtypes.from_config(load_config(cfg, 1))

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    # reduced in the compute dtype; summed over micro-steps in fp32 where that is a shard, else as computed
    assert dtypes(0) == dtypes(1) == GradDtypes(bf16, bf16, bf16)
    assert dtypes(2) == dtypes(3) == GradDtypes(bf16, bf16, fp32)
    assert dtypes(2, "fp16") == GradDtypes(fp16, fp16, fp32) and dtypes(1, "fp32") == GradDtypes(
        fp32, fp32, fp32
    )
    # DeepSpeed's spellings: communication_data_type any case, data_types by its DtypeEnum names
    assert dtypes(
        3, communication_data_type="FP32", data_types={"grad_accum_dtype": "bfloat16"}
    ) == GradDtypes(bf16, fp32, bf16)
    assert dtypes(
        1, "fp16", communication_data_type="fp32", data_types={"grad_accum_dtype": "float"}
    ) == GradDtypes(fp16, fp32, fp32)
    assert dtypes(2, data_types={"param_dtype": "bf16"}) == GradDtypes(
        bf16, bf16, fp32
    )  # matches: accepted
    assert not dtypes(2, communication_data_type="fp32").grad_lands_in_bucket


@pytest.mark.parametrize(
    "keys,message",
    [
        (
            {"communication_data_type": "fp8"},
            "communication_data_type: Input should be 'fp32', 'fp16' or 'bf16'",
        ),
        (
            {"data_types": {"grad_accum_dtype": "int8"}},
            "data_types.grad_accum_dtype: Input should be 'fp32', 'fp16'",
        ),
        (
            {"data_types": {"param_dtype": "fp16"}, "bf16": {"enabled": True}},
            "data_types.param_dtype: 'fp16' differs from the compute dtype 'bf16'",
        ),
        (
            {"data_types": {"buffer_dtype": "int8"}},
            "data_types.buffer_dtype: Input should be 'fp32', 'fp16'",
        ),
    ],
)
def test_invalid_values_are_refused_at_load(keys, message):
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, **keys}, 1)
    assert message in str(info.value)


def test_estimate_counts_the_dtypes():
    def est(stage, **keys):
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000},
            **keys,
        }
        return estimate(100_000, cfg, 4)

    assert est(2).device["gradients"] == 4 * 25_000  # fp32 shard by default
    assert est(2, data_types={"grad_accum_dtype": "bf16"}).device["gradients"] == 2 * 25_000
    assert est(1).device["gradients"] == 2 * 100_000  # the full gradient, in bf16
    # fp32 buckets: twice the bytes (stage 2: the one launching; stage 3: the autograd gradient is reduced
    # itself in bf16, in fp32 it is copied into a buffer)
    assert est(2).transients["gradient buckets"] == 2 * 1000 * 1
    assert est(2, communication_data_type="fp32").transients["gradient buckets"] == 4 * 1000 * 1
    assert est(3, communication_data_type="fp32").transients["gradient buckets"] == 4 * 1000 * 3
    assert est(1, communication_data_type="fp32").transients["gradient buckets"] == 4 * 1000 * 1
    assert "gradient buckets" not in est(1).transients
