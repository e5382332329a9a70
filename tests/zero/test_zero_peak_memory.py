"""The peak a rank really reaches (its resident high-water mark), against the ZeRO formulas.

Counted tensors (test_zero_memory.py) miss transients: a float64 copy of the gradient shard for its
norm, a model held twice while it is flattened, gradient buckets alive at once. Here each rank
measures its own resident memory (/proc/self/status, the high-water mark reset before each phase
through /proc/self/clear_refs) in units of the fp32 model's bytes, from a baseline taken after
torch's lazy imports and before the model is built, with glibc told to return freed blocks to the
system (``mallopt``), for a model whose states dominate everything else.

"Own" memory is the anonymous part (tensors, Python objects): the file-backed pages that first use
faults in from torch's libraries are shared by every rank and the page cache, and how many a fault
maps depends on what the page cache holds (CI's freshly installed torch maps 0.06 units more than a
warm machine), so they are taken out. The high-water mark counts both kinds; the peak of the own
part is bounded above by the mark less the shared pages mapped when the phase began (shared pages
only grow while a phase runs).
"""

import ctypes

import pytest
import torch
from torch import nn

import zengine
from configs import NO_PREFETCH, ds_config
from harness import spawn
from zengine.engine.engine import model_state_bytes
from zengine.estimate import estimate

LAYERS, WIDTH = (
    12,
    2048,
)  # 50M parameters: 201 MB, so that fixed costs (code, op libraries) are noise
PSI = LAYERS * WIDTH * WIDTH
UNIT = 4 * PSI  # bytes of the fp32 parameters
BUCKET = PSI // 12  # a tenth of a unit per bucket, as 5e6 elements are for a 50M-parameter model


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in f)
            if v.strip().endswith("kB")
        }


class _Meter:
    """This rank's own memory now, and an upper bound of its peak since the last reset, in bytes."""

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark restarts from the current resident set
        status = _status()
        self.shared = status["RssFile"] + status["RssShmem"]  # mapped library pages, not the rank's

    def read(self) -> tuple[int, int]:
        status = _status()
        return status["RssAnon"], status["VmHWM"] - self.shared


def _peaks(stage: int, with_init: bool = False, reversed_order: bool = False):
    ctypes.CDLL("libc.so.6").mallopt(
        -3, 65536
    )  # M_MMAP_THRESHOLD: large blocks go back to the system when freed
    torch.optim.AdamW(
        [nn.Parameter(torch.ones(2))], fused=True
    ).step()  # torch's lazy imports, before the baseline
    meter = _Meter()
    meter.reset()
    base, _ = meter.read()
    phases = {}

    def phase(name):
        own, peak = meter.read()
        phases[name] = ((own - base) / UNIT, (peak - base) / UNIT)
        meter.reset()

    torch.manual_seed(0)
    if with_init:
        with zengine.zero.Init():
            model = _model()
    else:
        model = _model()
    if reversed_order:
        model = _Reversed(model)
    phase("build")
    engine, *_ = zengine.initialize(model=model, config=_config(stage))
    phase("initialize")
    for _ in range(3):
        engine.backward(engine(torch.randn(2, WIDTH)).pow(2).mean())
        phase("backward")
        engine.step()
        phase("step")
    held = engine.memory_breakdown()
    if stage == 3:  # every parameter is back to its shard after the steps
        from zengine.zero.stage3.param import ParamState, lookup

        assert all(lookup(p).state is ParamState.SHARDED for p in model.parameters())
        return phases, model_state_bytes(held) / UNIT, held["parameters"] / UNIT
    return phases, model_state_bytes(held) / UNIT


class _Reversed(nn.Module):
    """Runs the layers last to first: backward produces gradients in registration order, the reverse
    of what the gradient buckets expect at first."""

    def __init__(self, layers: nn.Sequential):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in reversed(self.layers):
            x = layer(x)
        return x


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def _config(stage: int) -> dict:
    zero = {"reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if stage == 3:  # the least memory: one layer gathered (BUCKET is one layer), no prefetch, each
        # gradient reduced before backward goes on (the defaults would allow the whole model)
        zero.update(stage3_max_live_parameters=BUCKET, **NO_PREFETCH, overlap_comm=False)
    return ds_config(stage, lr=1e-4, zero=zero)


FORMULA = {
    0: lambda w: 4.0,
    1: lambda w: 2.0 + 2.0 / w,
    2: lambda w: 1.0 + 3.0 / w,
}  # fp32 Adam, in units of 4Ψ


@pytest.mark.parametrize("stage", [1, 2])
def test_peak_follows_the_formula(stage):
    world = 2
    formula = FORMULA[stage](world)
    predicted = estimate(_model(), _config(stage), world)  # zengine.estimate, before any training
    assert predicted.device_states / UNIT == pytest.approx(formula, rel=1e-3)
    for rank, (phases, counted) in enumerate(spawn(_peaks, world, stage, start="spawn")):
        assert counted == pytest.approx(formula, rel=1e-3), (rank, counted)
        worst = max(peak for _, peak in phases.values())
        held = phases["step"][0]
        report = f"stage {stage} rank {rank}: " + ", ".join(
            f"{k} {c:.2f}/{p:.2f}" for k, (c, p) in phases.items()
        )
        # what stays resident after a step: the formula, give or take allocator slack
        assert held <= formula + 0.15, report
        # the peak: the formula plus the documented transients (a few gradient buckets), within the target
        assert worst <= formula * 1.10 + 0.15, report
        # the model is never held twice while it is flattened into the engine's buffers
        assert phases["initialize"][1] <= phases["initialize"][0] + 0.15, report
        # the estimator's peak (states + transients) is within 10% of the peak measured
        assert predicted.peak_device / UNIT == pytest.approx(worst, rel=0.10), (
            predicted.format(),
            report,
        )


def test_stage3_with_zero_init_stays_partitioned_and_bounded():
    world = 4
    formula = 4.0 / world
    predicted = estimate(_model(), _config(3), world)
    for rank, (phases, counted, parameters) in enumerate(
        spawn(_peaks, world, 3, True, start="spawn")
    ):
        report = f"stage 3 + zero.Init rank {rank}: " + ", ".join(
            f"{k} {c:.2f}/{p:.2f}" for k, (c, p) in phases.items()
        )
        # a model built inside zero.Init holds 1/W of its parameters after training steps, as one the
        # engine partitioned does (it used to keep every parameter gathered after first use: 1.25 units)
        assert parameters == pytest.approx(1.0 / world, rel=1e-3), report
        assert counted == pytest.approx(formula, rel=1e-3), report
        # never whole: building, initialising and training stay near the shard
        assert phases["build"][1] <= 1.0 / world + 0.2, report
        assert phases["initialize"][1] <= 2.0 / world + 0.15, report
        # the peak: states plus the configured transients, as zengine.estimate says, and within the
        # memory issue's target for zero.Init at W=4 (1.25 units: a quarter of the model on top)
        worst = max(peak for _, peak in phases.values())
        assert worst <= formula + 0.25, report
        assert worst <= predicted.peak_device / UNIT * 1.10, (predicted.format(), report)
        assert worst == pytest.approx(predicted.peak_device / UNIT, rel=0.10), (
            predicted.format(),
            report,
        )


def test_gradient_peak_does_not_depend_on_the_order_backward_runs_in():
    # Buckets follow the order gradients completed in the first backward (all ranks agreeing): from the
    # second step on, a model run against its registration order peaks like one run in order (before:
    # the whole gradient waited for the first bucket, +1.1 units).
    world, stage = 2, 2
    formula = FORMULA[stage](world)
    for rank, (phases, counted) in enumerate(
        spawn(_peaks, world, stage, False, True, start="spawn")
    ):
        report = f"reversed stage 2 rank {rank}: " + ", ".join(
            f"{k} {c:.2f}/{p:.2f}" for k, (c, p) in phases.items()
        )
        assert phases["backward"][1] <= formula * 1.10 + 0.15, report  # the last step's backward
