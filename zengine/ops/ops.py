"""The compiled ops: one short declaration each (name, sources, flags).

This module imports nothing beyond the standard library, so ``setup.py`` can read it (for
``ZENGINE_BUILD_OPS=1``) without importing zengine or torch's extension tooling first.
Source paths are relative to the ``csrc/`` folder; ``csrc/includes`` is always on the
include path. See ``builder.py`` for how a declaration is built and loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "OpSpec",
    "CPU_ADAM",
    "FLATTEN",
    "UNSCALE_NORM",
    "ASYNC_IO",
    "QUANTIZE",
    "ALL_OPS",
    "COMMON_CFLAGS",
    "COMMON_LDFLAGS",
]

# -O3 and no -g keep builds small and fast; -ffp-contract=off keeps a*b+c as two roundings
# so every SIMD path gives the scalar path's bits; no -march: each SIMD path carries its
# own target attribute, so one build serves every x86 CPU.
COMMON_CFLAGS = (
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-Wno-psabi",
)
COMMON_LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class OpSpec:
    """A compiled op: its sources under ``csrc/`` and its compiler flags."""

    name: str  # short name: cache folder, JIT module ``zengine_<name>``, prebuilt ``zengine.ops._<name>``
    sources: tuple[str, ...]
    description: str
    cflags: tuple[str, ...] = COMMON_CFLAGS
    ldflags: tuple[str, ...] = COMMON_LDFLAGS
    include_dirs: tuple[str, ...] = ("includes",)

    @property
    def prebuilt_module(self) -> str:
        """The module name ``setup.py`` builds when ``ZENGINE_BUILD_OPS=1``."""
        return f"zengine.ops._{self.name}"

    @property
    def jit_module(self) -> str:
        """The module name of the just-in-time build (unique among torch extensions)."""
        return f"zengine_{self.name}"


CPU_ADAM = OpSpec(
    name="cpu_adam",
    sources=("adam/cpu_adam.cpp", "adam/cpu_adam_bf16.cpp", "adam/bindings.cpp"),
    description=(
        "Adam/AdamW step over a flat fp32 shard, with bf16/fp16 copy-out; over a bf16 master "
        "shard with bf16 or fp32 moments, rounded to nearest, Kahan or stochastically (SIMD, OpenMP)"
    ),
    include_dirs=("includes", "adam"),
)

FLATTEN = OpSpec(
    name="flatten",
    sources=("flatten/flatten.cpp", "flatten/bindings.cpp"),
    description="threaded copies of tensor lists into and out of one flat buffer",
    include_dirs=("includes", "flatten"),
)

UNSCALE_NORM = OpSpec(
    name="unscale_norm",
    sources=("norm/unscale_norm.cpp", "norm/bindings.cpp"),
    description="fused gradient unscale + sum of squares + non-finite check (SIMD, OpenMP)",
    include_dirs=("includes", "norm"),
)

ASYNC_IO = OpSpec(
    name="async_io",
    sources=("aio/async_io.cpp", "aio/bindings.cpp"),
    description="thread pool of pread/pwrite blocks for NVMe swapping (asynchronous file I/O)",
    include_dirs=("includes", "aio"),
)

QUANTIZE = OpSpec(
    name="quantize",
    sources=("quantize/quantize.cpp", "quantize/bindings.cpp"),
    description="ZeRO++ blockwise int8/int4 quantize and dequantize (SIMD, OpenMP)",
    include_dirs=("includes", "quantize"),
)

ALL_OPS: tuple[OpSpec, ...] = (CPU_ADAM, FLATTEN, UNSCALE_NORM, ASYNC_IO, QUANTIZE)
