"""What of tests/cuda runs without a GPU: the CUDA suite's own logic on the CPU, and the CPU suite's placement.

- the helpers the GPU tests use (``cuda_runs``), run here with device "cpu" and gloo at world size 1
  (a few cases of each kind, and the checkpoint save/load sequence with every side in that process):
  the checks pass where the engine is right, so a failure on the GPU is about the GPU;
- the reference check fails when the parameters or the losses are off (the checks can fail);
- gloo ranks compute on the CPU whether or not CUDA is visible (tests/conftest.py sets
  ZENGINE_DEVICE=cpu, but the backend alone must already mean the CPU), and make no CUDA context.
"""

import copy

import pytest
import torch

from cuda_runs import (
    CLIP,
    DEVICE_ENV,
    LR,
    STEPS,
    case_id,
    checkpoint_failures,
    ckpt_id,
    compare_with_reference,
    cpu_smoke,
    spawn_backend,
    stays_on_cpu,
)
from harness import spawn
from models import EdgeNet, make_batches, reference_run

SMOKE_PLAN = {
    "parity": [
        (2, "fp32", "none", 2, False),
        (3, "bf16", "cpu", 1, True),
        (1, "fp16", "nvme", 1, True),
    ],
    "overflow": [(1, "none", "inf"), (3, "param", "scale")],
    "init": [("bf16", "none")],
    "memory": [(3, "init")],
}


SMOKE_CHECKPOINT_CASES = [
    (2, "fp32", "none", "none"),
    (3, "bf16", "cpu", "cpu"),
    (2, "fp32", "cpu", "none"),
]


def test_cuda_suite_helpers_pass_on_the_cpu(tmp_path):
    """One gloo process (world size 1) runs a few cases of every kind, then the checkpoint sequence with
    every side in that process; where the engine is right on the CPU, the GPU suite's checks pass."""
    out = spawn_backend(
        cpu_smoke,
        1,
        "gloo",
        SMOKE_PLAN,
        str(tmp_path),
        SMOKE_CHECKPOINT_CASES,
        env=DEVICE_ENV,
        timeout=300,
    )[0]
    groups = out["groups"]
    failures = {
        f"{group}/{cid}": r["errors"]
        for group in SMOKE_PLAN
        for cid, r in groups[group].items()
        if r["errors"]
    }
    assert not failures, failures
    assert set(groups["parity"]) == {case_id(c) for c in SMOKE_PLAN["parity"]}
    assert groups["process"] == {
        "backend": "gloo",
        "placement": "cpu",
        "device": "cpu",
        "peak_bytes": None,
        "name": "cpu",
    }
    memory = groups["memory"]["s3-init"]  # no device peak on the CPU; the states are counted
    assert memory["peak"] is None and memory["counted"] == pytest.approx(4.0, rel=1e-3), memory
    assert memory["estimate"] >= 4.0, memory
    parity = groups["parity"]["s2-fp32-none-gas2"]
    assert parity["max_param_error"] <= 1e-5 and parity["off_over_moved"] <= 1e-5, parity
    overflow = groups["overflow"]["s1-none-inf"]
    assert overflow["scale_after"] == overflow["scale_before"] / 2, overflow

    probe = out["probe"]  # the placement checks can fail
    assert probe["right"] == [] and probe["stops"], probe
    assert any("engine.device is cpu, expected meta" in e for e in probe["wrong_device"]), probe
    assert any("module parameters off meta" in e for e in probe["wrong_device"]), probe
    assert probe["watch_wrong"], probe
    for what in ("fp32 master", "optimizer state", "gradient buffer", "stage-3 parameter shard"):
        assert any(what in e for e in probe["wrong_offload"]), (what, probe)
    assert not any("fp32 master" in e or "optimizer state" in e for e in probe["wrong_device"]), (
        probe
    )

    results = out["checkpoint"]
    for case in SMOKE_CHECKPOINT_CASES:
        for direction in ("device-to-cpu", "cpu-to-device"):
            assert checkpoint_failures(results, case, direction) == [], (case, direction)
    # the comparison can fail: other losses, other parameters on the loading side
    loaded = results["cpu_loaded"][ckpt_id(SMOKE_CHECKPOINT_CASES[0])]
    loaded["losses"][0] *= 1.001
    loaded["params"]["fc1.bias"][0] += 1.0
    errors = checkpoint_failures(results, SMOKE_CHECKPOINT_CASES[0], "device-to-cpu")
    assert any("continued losses" in e for e in errors) and any("fc1.bias" in e for e in errors), (
        errors
    )


def test_the_reference_check_can_fail():
    torch.manual_seed(0)
    init = EdgeNet()
    batches = make_batches(STEPS, 2)
    norms = []
    losses, params = reference_run(init, batches, LR, CLIP, norms=norms)
    cpu = torch.device("cpu")
    errors, _ = compare_with_reference(
        "exact",
        {n: p.float() for n, p in params.items()},
        losses,
        norms,
        init,
        batches,
        "fp32",
        cpu,
    )
    assert errors == []  # the reference's own values pass
    norms = [n * 1.001 for n in norms]
    off = {n: p.float() for n, p in params.items()}
    off["fc1.weight"] = off["fc1.weight"] + 1e-3
    errors, _ = compare_with_reference("off", off, losses, norms, init, batches, "fp32", cpu)
    assert any("max parameter error" in e for e in errors) and any(
        "global norms" in e for e in errors
    ), errors
    changed = copy.deepcopy(params)
    changed["unused.bias"] = changed["unused.bias"] + 1.0
    errors, _ = compare_with_reference(
        "unused", changed, [x * 1.1 for x in losses], norms, init, batches, "fp16", cpu
    )
    assert any("unused.bias changed" in e for e in errors) and any("losses" in e for e in errors), (
        errors
    )


@pytest.fixture(scope="module")
def gloo_ranks():
    return spawn(stays_on_cpu, 2)


def test_gloo_ranks_compute_on_the_cpu_even_where_cuda_is_visible(gloo_ranks):
    for rank, out in enumerate(gloo_ranks):
        assert out["placement_default"] == "cpu" and out["placement_env_cpu"] == "cpu", (rank, out)
        for name, engine in out["engines"].items():
            assert engine["engine"] == "cpu" and engine["errors"] == [], (rank, name, engine)


def test_gloo_training_makes_no_cuda_context(gloo_ranks):
    for rank, out in enumerate(gloo_ranks):
        assert not out["cuda_initialized_before"] and not out["cuda_initialized_after"], (
            f"rank {rank}: a gloo (CPU) run initialised CUDA (a pinned buffer, a .cuda(), a CUDA stream or event?)"
        )
