"""On one GPU (NCCL, world size 1, cuda:0): every stage, precision and offload trains like plain torch on
the same GPU; fp16 overflows are skipped; zero.Init and GatheredParameters work with CUDA parameters.

All cases run in ONE spawned process (``cuda_runs.run_groups``); each parametrized test asserts one
case's result, so a failure names its combination: ``s<stage>-<precision>-<offload>-gas<n>[-allused]``
(``allused``: EdgeNet's unused layer frozen, so that the offloaded step takes the copy-out path).
"""

import pytest
import torch

from cuda_runs import DEVICE_ENV, case_id, run_groups, spawn_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZER_OFFLOADS = ("none", "cpu", "nvme")


def _parity_cases() -> list:
    cases = []
    for stage in range(4):
        for pi, precision in enumerate(PRECISIONS):
            for oi, offload in enumerate(OPTIMIZER_OFFLOADS):
                if stage == 0 and offload != "none":  # optimizer offload needs stage 1-3
                    continue
                gas = 2 if (stage + pi + oi) % 2 else 1
                all_used = offload != "none" and (stage + pi) % 2 == 0
                cases.append((stage, precision, offload, gas, all_used))
    # stage 3 parameter offload (with the optimizer on the host too)
    cases += [
        (3, "fp32", "param", 1, True),
        (3, "bf16", "param", 2, False),
        (3, "fp16", "param", 1, False),
        (3, "fp32", "param+nvme", 2, True),
    ]
    return cases


PARITY_CASES = _parity_cases()
# (stage, offload, how): "inf" injects an Inf into fc1.weight's gradient, "scale" sets the loss scale to 2**40
OVERFLOW_CASES = [
    (0, "none", "scale"),
    (1, "none", "inf"),
    (1, "cpu", "scale"),
    (2, "none", "inf"),
    (2, "nvme", "inf"),
    (3, "none", "scale"),
    (3, "param", "inf"),
]
# (precision, offload), stage 3
INIT_CASES = [("fp32", "none"), ("bf16", "none"), ("fp16", "cpu"), ("fp32", "param")]
# (stage, how): peak device memory of 12 x Linear(2048) fp32 against the formulas
MEMORY_CASES = [(0, "plain"), (1, "plain"), (2, "plain"), (3, "plain"), (3, "init")]
PLAN = {
    "parity": PARITY_CASES,
    "overflow": OVERFLOW_CASES,
    "init": INIT_CASES,
    "memory": MEMORY_CASES,
}


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    nvme = str(tmp_path_factory.mktemp("cuda-nvme"))
    return spawn_backend(run_groups, 1, "nccl", PLAN, "cuda", nvme, env=DEVICE_ENV, timeout=900)[0]


def _assert_ok(result: dict) -> None:
    assert not result["errors"], "\n".join(result["errors"])


def test_the_process_computes_on_cuda0(gpu):
    process = gpu["process"]
    assert process["backend"] == "nccl"
    assert process["placement"] == "cuda:0" and process["device"] == "cuda:0", process
    assert process["peak_bytes"] > 0, process


@pytest.mark.parametrize("case", PARITY_CASES, ids=case_id)
def test_training_matches_torch_on_the_gpu(gpu, case):
    _assert_ok(gpu["parity"][case_id(case)])


@pytest.mark.parametrize("case", OVERFLOW_CASES, ids=case_id)
def test_fp16_overflow_step_is_skipped(gpu, case):
    _assert_ok(gpu["overflow"][case_id(case)])


@pytest.mark.parametrize("case", INIT_CASES, ids=case_id)
def test_zero_init_and_gathered_parameters_on_cuda(gpu, case):
    _assert_ok(gpu["init"][case_id(case)])


def test_peak_gpu_memory_is_recorded(gpu):
    peaks = {
        f"{group}/{cid}": r.get("peak_bytes")
        for group in ("parity", "init")
        for cid, r in gpu[group].items()
    }
    recorded = {k: v for k, v in peaks.items() if v is not None}
    print("\npeak torch.cuda.max_memory_allocated per case (bytes):")
    for k, v in recorded.items():
        print(f"  {k}: {v}")
    assert recorded and all(v > 0 for v in recorded.values()), peaks


@pytest.mark.parametrize("case", MEMORY_CASES, ids=[case_id(c) for c in MEMORY_CASES])
def test_peak_gpu_memory_follows_the_formula(gpu, case):
    """torch.cuda.max_memory_allocated over build, initialize and 3 steps, in units of the fp32 model: at
    world size 1 every stage holds 4 units (parameters, gradients, Adam's two moments); the peak is
    that plus the documented transients (the memory issue's targets) and within 10% of zengine.estimate.
    Counted after the steps, stages 2-3 hold 3: their gradient shards on a GPU exist from a window's
    first reduction to zero_grad (offload/landing.py), as FSDP2's gradients are set to None."""
    result = gpu["memory"][case_id(case)]
    _assert_ok(result)
    stage = case[0]
    formula = 4.0
    report = f"{case_id(case)}: {result}"
    kept = formula - (1.0 if stage >= 2 else 0.0)
    assert result["counted"] == pytest.approx(kept, rel=1e-3), report
    bound = formula + 0.25 if stage == 3 else formula * 1.10 + 0.15
    assert result["peak"] <= bound, report
    assert result["peak"] == pytest.approx(result["estimate"], rel=0.10), report
