"""Where bf16 matrix multiplies on the CPU run: the matmul policy, chosen once when the engine is built.

torch computes a CPU bf16 GEMM with bf16 dot-product instructions where the CPU has them (AVX512-BF16,
AMX-BF16). Elsewhere (AVX2, AVX-512 without BF16: most x86 servers in use) it is emulated, at 1/4 to
1/100 of the fp32 rate, the input-gradient layout ``grad @ weight`` slowest (0.5 GFLOP/s against 86 in
fp32). Up-casting the operands costs one pass over each, far less than an emulated product, so on such
CPUs ``Fp32Matmul`` runs every ``nn.Linear`` through ``Fp32Linear`` (fp32 products, bf16 in and out):
storage, communication and swap stay bf16 as asked.

``bf16.cpu_matmul`` chooses: "native", "fp32", or "auto" (the CPU's flags, from /proc/cpuinfo or
py-cpuinfo, and oneDNN's ``ONEDNN_MAX_CPU_ISA`` cap when set). With AVX512-BF16 but no AMX the two are
close (torch's bf16 GEMM measured at 0.5-1x its fp32 rate; the upcasts cost as much as the product at a
few dozen tokens): "auto" keeps native there, and ``zengine-report`` shows this CPU's rates for a choice
by hand. Only CPU-computed bf16 is touched: any other compute device or dtype gets ``NativeMatmul``,
which does nothing. ``measure_gemm_rates`` times the three products of a linear layer per dtype.
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

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (the kernel's and py-cpuinfo's names) of the bf16 dot-product instructions torch's GEMM uses."""
# oneDNN runs torch's CPU bf16 GEMMs; ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 (AVX2, AVX512_CORE, ...)
# leaves its emulated kernels, whatever the CPU has. The ISA names from AVX512_CORE_BF16 up hold one of these.
_ONEDNN_BF16_ISA_WORDS = ("BF16", "FP16", "AMX", "AVX10", "ALL", "DEFAULT")


def _kernel_flags() -> Optional[frozenset]:
    """The flags line of /proc/cpuinfo (Linux; the kernel's names, which py-cpuinfo reports too), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    """This CPU's feature flags (e.g. ``avx2``, ``avx512_bf16``, ``amx_bf16``): /proc/cpuinfo's where there
    is one (read in microseconds), else py-cpuinfo's (about a second: it probes in a subprocess); empty
    when neither is available."""
    flags = _kernel_flags()
    if flags is not None:
        return flags
    try:
        import cpuinfo

        return frozenset(cpuinfo.get_cpu_info().get("flags", []))
    except (
        Exception
    ):  # py-cpuinfo missing, or its probe failed: nothing known, "auto" takes the safe path
        return frozenset()


def native_bf16(flags: Iterable[str], onednn_isa: Optional[str] = None) -> bool:
    """True when torch's CPU bf16 GEMM runs on bf16 instructions: the CPU has AVX512-BF16 or AMX-BF16 and
    oneDNN is not capped below them (``onednn_isa``: the value of ``ONEDNN_MAX_CPU_ISA``, None when unset)."""
    if not any(f in NATIVE_BF16_FLAGS for f in flags):
        return False
    return onednn_isa is None or any(word in onednn_isa.upper() for word in _ONEDNN_BF16_ISA_WORDS)


NOT_CPU_BF16 = "not bf16 on the CPU"
"""The reason of the policy of every run that does not compute bf16 on the CPU (nothing is routed or logged)."""


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


# The methods of an nn.Linear that may be nn.Linear's own forward, i.e. the product Fp32Matmul routes: forward
# itself, or ``project`` in a subclass that adds behaviour around its product (zengine.models.gpt.LMHead).
PRODUCT_METHODS = ("forward", "project")


class Fp32Matmul(MatmulPolicy):
    """Every ``nn.Linear`` (whose forward is nn.Linear's own, not a subclass's) runs its products in fp32;
    so does a subclass that adds behaviour around its product and computes that product through
    ``self.project(x)`` with ``project = nn.Linear.forward`` (``zengine.models.gpt.LMHead``: the loss after
    the projection); a subclass with any other forward is left alone.

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
            if not isinstance(m, nn.Linear):
                continue
            for name in PRODUCT_METHODS:
                if getattr(type(m), name, None) is nn.Linear.forward and name not in vars(m):
                    setattr(m, name, _LinearForward(m, self.scratch))
                    self.routed.append(m)
                    break
        return len(self.routed)

    def remove(self) -> None:
        for m in self.routed:
            for name in PRODUCT_METHODS:
                if isinstance(vars(m).get(name), _LinearForward):
                    delattr(m, name)
        self.routed = []


def choose_matmul_policy(
    setting: str,
    compute_dtype: torch.dtype,
    device: torch.device,
    flags: Optional[Iterable[str]] = None,
) -> MatmulPolicy:
    """The policy for ``bf16.cpu_matmul`` = ``setting`` ("auto", "fp32", "native"). Anything but bf16
    computed on the CPU gets ``NativeMatmul``. ``flags``: the CPU's (default: ``cpu_flags()``)."""
    if compute_dtype is not torch.bfloat16 or torch.device(device).type != "cpu":
        return NativeMatmul(NOT_CPU_BF16)
    if setting == "native":
        return NativeMatmul("bf16.cpu_matmul is \"native\"")
    if setting == "fp32":
        return Fp32Matmul("bf16.cpu_matmul is \"fp32\"")
    if setting != "auto":
        raise ValueError(
            f"bf16.cpu_matmul: {setting!r} is not one of \"auto\", \"fp32\", \"native\""
        )
    flags = cpu_flags() if flags is None else frozenset(flags)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if native_bf16(flags, isa):
        have = " and ".join(f for f in NATIVE_BF16_FLAGS if f in flags)
        return NativeMatmul(
            f"auto: the CPU has {have}; set bf16.cpu_matmul to \"fp32\" where zengine-report "
            "measures fp32 faster"
        )
    if any(f in NATIVE_BF16_FLAGS for f in flags):
        why = f"oneDNN is capped at ONEDNN_MAX_CPU_ISA={isa}"
    elif not flags:
        why = "the CPU's flags are unknown"
    else:
        why = "the CPU has no bf16 instructions (avx512_bf16, amx_bf16)"
    return Fp32Matmul(
        f"auto: {why}, where torch's bf16 GEMM is emulated and slow; set bf16.cpu_matmul to "
        "\"native\" to keep it"
    )


_logged: set = set()


def log_choice(policy: MatmulPolicy, routed: int) -> None:
    """Log the choice, once per process for each distinct choice (several engines say it once)."""
    line = policy.describe() + (
        f"; {routed} nn.Linear layer(s) routed" if policy.mode == "fp32" else ""
    )
    if (
        policy.reason != NOT_CPU_BF16 and line not in _logged
    ):  # GPU, fp32, fp16 runs: nothing to say
        _logged.add(line)
        logger.info("zengine: %s", line)


# -- measured rates (zengine-report) ------------------------------------------------------------
LAYOUTS = {
    "forward x @ W.T": lambda x, w, g: x @ w.t(),
    "weight grad g.T @ x": lambda x, w, g: g.t() @ x,
    "input grad g @ W": lambda x, w, g: g @ w,
}
"""The three products of a linear layer (x [tokens, in], W [out, in], g [tokens, out])."""


def _via_fp32(scratch: Fp32Scratch) -> dict:
    """``LAYOUTS`` on bf16 operands as ``Fp32Linear`` runs them: upcast (weight-sized ones in the scratch),
    multiply in fp32, round the product to bf16."""
    return {
        "forward x @ W.T": lambda x, w, g: (x.float() @ scratch.upcast(w).t()).bfloat16(),
        "weight grad g.T @ x": lambda x, w, g: torch.mm(
            g.float().t(), x.float(), out=scratch.take(w.shape)
        ).bfloat16(),
        "input grad g @ W": lambda x, w, g: (g.float() @ scratch.upcast(w)).bfloat16(),
    }


def _rate(fn, flops: float, budget_s: float) -> float:
    """GFLOP/s of the fastest of the calls made within ``budget_s`` (at least two): the least disturbed by
    other work on a shared machine."""
    fn()  # warm-up (kernel selection, first-touch pages)
    began, best = time.perf_counter(), float("inf")
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 - began >= budget_s:
            return flops / best / 1e9


def measure_gemm_rates(
    tokens: int = 64, width: int = 1024, budget_s: float = 0.1
) -> dict[str, dict[str, float]]:
    """GFLOP/s of each linear-layer product (``LAYOUTS``; ``tokens`` x ``width`` -> 4 ``width``) on this CPU
    with torch's current threads: ``{"fp32": {...}, "bf16": {...}, "bf16 via fp32": {...}}``, the last as
    ``Fp32Matmul`` runs it (upcasts and the rounding included)."""
    g = torch.Generator().manual_seed(0)
    x, w, grad = (
        torch.randn(shape, generator=g)
        for shape in ((tokens, width), (4 * width, width), (tokens, 4 * width))
    )
    flops = 2.0 * tokens * width * 4 * width
    runs = (
        ("fp32", torch.float32, LAYOUTS),
        ("bf16", torch.bfloat16, LAYOUTS),
        ("bf16 via fp32", torch.bfloat16, _via_fp32(Fp32Scratch())),
    )
    out: dict[str, dict[str, float]] = {}
    for name, dtype, layouts in runs:
        a, b, c = x.to(dtype), w.to(dtype), grad.to(dtype)
        out[name] = {k: _rate(lambda f=f: f(a, b, c), flops, budget_s) for k, f in layouts.items()}
    return out
