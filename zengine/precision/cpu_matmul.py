"""Where bf16 matrix multiplies on the CPU run: the matmul policy, chosen once when the engine is built.

torch computes a CPU bf16 GEMM natively only with AMX-BF16 (Sapphire Rapids and later). Elsewhere
it is emulated: with AVX512-BF16 (no AMX) measured at 0.5-0.9x of the fp32 rate, and without it
(AVX2, AVX-512 without BF16: most x86 servers in use) at 1/4 to 1/100 of it, the input-gradient
layout ``grad @ weight`` slowest (0.5 GFLOP/s against 86). Up-casting the operands costs one pass over
each, far less than the product, so on such CPUs ``Fp32Matmul`` runs every ``nn.Linear`` through
``Fp32Linear`` (fp32 products, bf16 in and out): storage, communication and swap stay bf16 as asked.

``bf16.cpu_matmul`` chooses: "native", "fp32", or "auto" (the CPU's flags, read with py-cpuinfo, and
oneDNN's ``ONEDNN_MAX_CPU_ISA`` cap when set). Only CPU-computed bf16 is touched: any other compute
device or dtype gets ``NativeMatmul``, which does nothing. ``measure_gemm_rates`` (``zengine-report``)
times the three products of a linear layer per dtype on this CPU.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import Iterable, Optional

import torch
from torch import nn

from .fp32_linear import Fp32Scratch, fp32_linear

logger = logging.getLogger("zengine")

NATIVE_BF16_FLAGS = ("amx_bf16",)
"""CPU flags (py-cpuinfo's names) with which torch's bf16 GEMM is faster than its fp32 one."""
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""Flags of any bf16 dot-product instruction (reported; AVX512-BF16 alone is still slower than fp32)."""
# oneDNN runs torch's CPU bf16 GEMMs; a cap below AMX (ONEDNN_MAX_CPU_ISA=AVX2, AVX512_CORE_BF16, ...)
# leaves the emulated or AVX512-BF16 kernels, whatever the CPU has.
_ONEDNN_AMX_ISAS = ("AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX10_2_512_AMX", "ALL", "DEFAULT")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    """This CPU's feature flags (py-cpuinfo's names, e.g. ``avx2``, ``avx512_bf16``, ``amx_bf16``);
    empty when py-cpuinfo is missing or fails."""
    try:
        import cpuinfo

        return frozenset(cpuinfo.get_cpu_info().get("flags", []))
    except Exception:  # py-cpuinfo missing, or its probe failed: nothing known, "auto" takes the safe path
        return frozenset()


def native_bf16(flags: Iterable[str], onednn_isa: Optional[str] = None) -> bool:
    """True when torch's CPU bf16 GEMM is faster than its fp32 one: the CPU has AMX-BF16 and oneDNN is
    not capped below it (``onednn_isa``: the value of ``ONEDNN_MAX_CPU_ISA``, None when unset)."""
    if not any(f in NATIVE_BF16_FLAGS for f in flags):
        return False
    return onednn_isa is None or onednn_isa.strip().upper() in _ONEDNN_AMX_ISAS


class MatmulPolicy:
    """Where the model's bf16 matrix multiplies run; ``apply`` once to the model, ``remove`` to undo.

    ``mode`` is "native" or "fp32"; ``reason`` says why, for the log and ``zengine-report``."""

    mode = "native"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def apply(self, model: nn.Module) -> int:
        """Route the model's linear layers; returns how many were routed."""
        return 0

    def remove(self) -> None:
        """Give every routed layer its own forward back."""

    def describe(self) -> str:
        """One line for the log."""
        return f"bf16 matrix multiplies on the CPU: {self.mode} ({self.reason})"


class NativeMatmul(MatmulPolicy):
    """torch's own kernels, untouched (GPU runs, fp32/fp16, CPUs with native bf16, or asked for)."""


class _LinearForward:
    """The forward of one routed ``nn.Linear``: its current weight and bias through ``fp32_linear``
    (read at each call: stage 3 swaps their ``.data``, a script may replace them)."""

    def __init__(self, module: nn.Linear, scratch: Fp32Scratch) -> None:
        self.module = module
        self.scratch = scratch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_linear(x, self.module.weight, self.module.bias, self.scratch)


class Fp32Matmul(MatmulPolicy):
    """Every ``nn.Linear`` (whose forward is nn.Linear's own, not a subclass's) runs its products in fp32.

    The layer keeps its class, parameters and hooks (stage 3's gathers, checkpointing's recompute run as
    before); only its ``forward`` is an instance attribute until ``remove``. Costs one fp32 buffer of the
    largest weight (``scratch``), reused by every layer."""

    mode = "fp32"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.scratch = Fp32Scratch()
        self.routed: list[nn.Linear] = []

    def apply(self, model: nn.Module) -> int:
        for m in model.modules():
            if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in vars(m):
                m.forward = _LinearForward(m, self.scratch)
                self.routed.append(m)
        return len(self.routed)

    def remove(self) -> None:
        for m in self.routed:
            if isinstance(vars(m).get("forward"), _LinearForward):
                del m.forward
        self.routed = []


def choose_matmul_policy(setting: str, compute_dtype: torch.dtype, device: torch.device,
                         flags: Optional[Iterable[str]] = None) -> MatmulPolicy:
    """The policy for ``bf16.cpu_matmul`` = ``setting`` ("auto", "fp32", "native"). Anything but bf16
    computed on the CPU gets ``NativeMatmul``. ``flags``: the CPU's (default: read with py-cpuinfo)."""
    if compute_dtype is not torch.bfloat16 or torch.device(device).type != "cpu":
        return NativeMatmul("not bf16 on the CPU")
    if setting == "native":
        return NativeMatmul("bf16.cpu_matmul is \"native\"")
    if setting == "fp32":
        return Fp32Matmul("bf16.cpu_matmul is \"fp32\"")
    if setting != "auto":
        raise ValueError(f"bf16.cpu_matmul: {setting!r} is not one of \"auto\", \"fp32\", \"native\"")
    flags = cpu_flags() if flags is None else frozenset(flags)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if native_bf16(flags, isa):
        return NativeMatmul("auto: the CPU has AMX-BF16")
    have = [f for f in BF16_FLAGS if f in flags]
    if any(f in NATIVE_BF16_FLAGS for f in flags):
        why = f"oneDNN is capped at ONEDNN_MAX_CPU_ISA={isa}"
    elif not flags:
        why = "the CPU's flags are unknown (py-cpuinfo)"
    elif have:
        why = f"the CPU has {' and '.join(have)} but no amx_bf16"
    else:
        why = "the CPU has no bf16 instructions"
    return Fp32Matmul(f"auto: {why}, where torch's bf16 GEMM is slower than fp32; "
                      "set bf16.cpu_matmul to \"native\" to keep it")


_logged: set = set()


def log_choice(policy: MatmulPolicy, routed: int) -> None:
    """Log the choice, once per process for each distinct choice (several engines say it once)."""
    line = policy.describe() + (f"; {routed} nn.Linear layer(s) routed" if policy.mode == "fp32" else "")
    if policy.reason != "not bf16 on the CPU" and line not in _logged:
        _logged.add(line)
        logger.info("zengine: %s", line)


# -- measured rates (zengine-report) ------------------------------------------------------------
LAYOUTS = {"forward x @ W.T": lambda x, w, g: x @ w.t(),
           "weight grad g.T @ x": lambda x, w, g: g.t() @ x,
           "input grad g @ W": lambda x, w, g: g @ w}
"""The three products of a linear layer (x [tokens, in], W [out, in], g [tokens, out])."""


def _rate(fn, flops: float, budget_s: float) -> float:
    fn()  # warm-up (kernel selection, first-touch pages)
    began, calls = time.perf_counter(), 0
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - began
        if elapsed >= budget_s:
            return flops * calls / elapsed / 1e9


def measure_gemm_rates(tokens: int = 64, width: int = 1024, budget_s: float = 0.05) -> dict[str, dict[str, float]]:
    """GFLOP/s of each linear-layer product (``LAYOUTS``) on this CPU with torch's current threads:
    ``{"fp32": {...}, "bf16": {...}, "bf16 via fp32": {...}}``, the last with the operands upcast from
    bf16 and the product rounded back (what ``Fp32Matmul`` runs; upcasts included in its time)."""
    g = torch.Generator().manual_seed(0)
    x, w, grad = (torch.randn(shape, generator=g) for shape in ((tokens, width), (4 * width, width),
                                                                (tokens, 4 * width)))
    flops = 2.0 * tokens * width * 4 * width
    out: dict[str, dict[str, float]] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b, c = x.to(dtype), w.to(dtype), grad.to(dtype)
        out[name] = {k: _rate(lambda f=f: f(a, b, c), flops, budget_s) for k, f in LAYOUTS.items()}
    a, b, c = x.bfloat16(), w.bfloat16(), grad.bfloat16()
    out["bf16 via fp32"] = {k: _rate(lambda f=f: f(a.float(), b.float(), c.float()).bfloat16(), flops, budget_s)
                            for k, f in LAYOUTS.items()}
    return out
