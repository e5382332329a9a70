"""bf16 with ``bf16.cpu_matmul: "fp32"`` (every nn.Linear's products in fp32, bf16 in and out) at stages 2 and 3,
stage 3 also with parameters and optimizer on NVMe: the bf16 parity tolerances of test_zero_parity.py hold
against the single-process fp32 reference, and the fp32 path is the one that ran. At stage 3 with activation
checkpointing (test_checkpointing.py's model and run), checkpointed training equals plain training."""

import torch

import test_zero_parity as parity
from harness import spawn

CASES = [(2, "bf16", 1), (2, "bf16", 3), (3, "bf16", 1), (3, "bf16", 3, "infinity")]


def _count_fp32_linear_calls() -> list:
    """Record the input dtype of every call of the routed layers' forward (this process)."""
    from zengine.precision import cpu_matmul

    calls = []
    routed = cpu_matmul.fp32_linear

    def counted(x, weight, bias, scratch):
        calls.append(x.dtype)
        return routed(x, weight, bias, scratch)

    cpu_matmul.fp32_linear = counted
    return calls


def _parity_with_fp32_matmuls(cases, setting):
    calls = _count_fp32_linear_calls()
    plain_config = parity.engine_config

    def config(*args, **kwargs):
        cfg = plain_config(*args, **kwargs)
        cfg["bf16"]["cpu_matmul"] = setting
        return cfg

    parity.engine_config = config
    worst = parity.parity_matrix(cases)
    return worst, len(calls), set(calls)


def test_bf16_parity_with_fp32_matmuls():
    # ("native" is what every other bf16 test runs on a CPU with AMX; "auto" on this one is "fp32")
    for worst, calls, dtypes in spawn(_parity_with_fp32_matmuls, 2, CASES, "fp32"):
        # EdgeNet runs fc1, frozen, fc2, mix twice and the tied head in every forward
        assert calls >= 6 * parity.STEPS * len(CASES) and dtypes == {torch.bfloat16}


def _checkpointed_stage3_with_fp32_matmuls():
    import test_checkpointing as ckpt

    calls = _count_fp32_linear_calls()
    plain_config = ckpt.engine_config
    ckpt.engine_config = lambda stage, cpu_checkpointing=False: {
        **plain_config(stage, cpu_checkpointing),
        "bf16": {"enabled": True, "cpu_matmul": "fp32"},
    }
    return ckpt.same_training_with_and_without_checkpointing(3), len(calls)


def test_checkpointed_stage3_with_fp32_matmuls_trains_as_without_checkpointing():
    # plain, checkpointed and CPU-checkpointed runs of 3 steps: 7 routed layers per forward, recomputes on top
    for same, calls in spawn(_checkpointed_stage3_with_fp32_matmuls, 2):
        assert same and calls > 3 * 3 * 7
