"""``zengine-report``: the environment the compiled ops see, and where each op stands.

zengine-report            # versions, CPU features, op status (builds nothing), bf16 GEMM rates
zengine-report --build    # also build every op that is not built yet, and time it
zengine-report --no-gemm  # without timing the GEMMs (about a second; longer on CPUs without native bf16)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time

__all__ = ["main", "collect"]

_SIMD_FLAGS = (
    "amx_bf16",
    "avx512_bf16",
    "avx512f",
    "avx2",
    "fma",
    "f16c",
    "avx",
    "sse4_2",
    "neon",
    "asimd",
)


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not found ({err.__class__.__name__})"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else f"exit code {out.returncode}"


def _cpu_features() -> tuple[str, list[str]]:
    try:
        import cpuinfo
    except ImportError:
        return platform.processor() or platform.machine(), ["(py-cpuinfo not installed)"]
    info = cpuinfo.get_cpu_info()
    flags = set(info.get("flags", []))
    return info.get("brand_raw", platform.machine()), [f for f in _SIMD_FLAGS if f in flags]


def _bf16_matmul(measure: bool) -> dict[str, object]:
    """What an engine computing bf16 on this CPU does with its matrix multiplies under the default
    ``bf16.cpu_matmul`` ("auto"), and (``measure``) the GEMM rates behind it."""
    import torch

    from ..precision.cpu_matmul import choose_matmul_policy, measure_gemm_rates

    policy = choose_matmul_policy("auto", torch.bfloat16, torch.device("cpu"))
    out: dict[str, object] = {"bf16_cpu_matmul": f"{policy.mode} ({policy.reason})"}
    if measure:
        out["gemm_rates"] = measure_gemm_rates()
    return out


def collect(measure_gemm: bool = False) -> dict[str, object]:
    """Everything the report prints, as a dict (for tests and tools); ``measure_gemm`` also times the
    GEMMs of a linear layer per dtype and layout (``gemm_rates``, GFLOP/s)."""
    import torch

    from .adam import simd_path, simd_paths
    from .builder import cache_dir, csrc_dir, get_builder
    from .ops import ALL_OPS

    brand, flags = _cpu_features()
    compiler = os.environ.get("CXX", "c++")
    ninja = shutil.which("ninja")
    report: dict[str, object] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "compiler": f"{compiler}: {_first_line([compiler, '--version']) if shutil.which(compiler) else 'not found'}",
        "ninja": _first_line([ninja, "--version"]) if ninja else "not found",
        "cpu": brand,
        "cpu_features": flags,
        "csrc": str(csrc_dir()) if csrc_dir() else "not found",
        "cache": str(cache_dir()),
        "ZENGINE_SIMD": os.environ.get("ZENGINE_SIMD", "(unset)"),
        "ZENGINE_DISABLE_OPS": os.environ.get("ZENGINE_DISABLE_OPS", "(unset)"),
        **_bf16_matmul(measure_gemm),
        "ops": {},
    }
    for spec in ALL_OPS:
        status = get_builder(spec.name).status()
        report["ops"][spec.name] = (status.state.value, status.detail, spec.description)
    if report["ops"]["cpu_adam"][0] in ("built", "prebuilt"):
        report["simd_paths"] = ", ".join(simd_paths())
        try:
            report["simd_path"] = simd_path()
        except RuntimeError as err:  # e.g. ZENGINE_SIMD names a path the CPU lacks
            report["simd_path"] = f"error: {err}"
    return report


def _print(report: dict[str, object]) -> None:
    width = 22
    for key, value in report.items():
        if key in ("ops", "gemm_rates"):
            continue
        if isinstance(value, list):
            value = " ".join(value)
        print(f"{key:<{width}} {value}")
    print()
    print(f"{'op':<14} {'status':<14} detail")
    for name, (state, detail, description) in report["ops"].items():
        print(f"{name:<14} {state:<14} {detail}")
        print(f"{'':<14} {'':<14} ({description})")
    if "gemm_rates" in report:
        _print_rates(report["gemm_rates"], report["torch_threads"])


def _print_rates(rates: dict[str, dict[str, float]], threads: object) -> None:
    layouts = list(next(iter(rates.values())))
    print()
    print(
        f"GEMM GFLOP/s on this CPU (best call; {threads} torch threads; 64 tokens, 1024 -> 4096 as a linear layer):"
    )
    print(f"{'dtype':<14} " + " ".join(f"{name:>20}" for name in layouts))
    for dtype, per_layout in rates.items():
        print(f"{dtype:<14} " + " ".join(f"{per_layout[name]:>20.1f}" for name in layouts))
    print(
        "(bf16 via fp32: bf16 operands upcast, product rounded to bf16: what bf16.cpu_matmul \"fp32\" runs)"
    )
    # a layer's forward+backward runs each product once: its time is the sum of the three
    per_step = {
        dtype: sum(1.0 / r for r in per_layout.values()) for dtype, per_layout in rates.items()
    }
    print(
        "one layer's forward+backward, relative to fp32: "
        + ", ".join(f"{dtype} {t / per_step['fp32']:.2f}x" for dtype, t in per_step.items())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zengine-report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--build", action="store_true", help="build every op that is not built yet, timing each"
    )
    parser.add_argument("--no-gemm", action="store_true", help="do not time the fp32/bf16 GEMMs")
    args = parser.parse_args(argv)
    if args.build:
        from .builder import get_builder
        from .ops import ALL_OPS

        for spec in ALL_OPS:
            start = time.perf_counter()
            ok = get_builder(spec.name).load() is not None
            print(
                f"{spec.name}: {'ready' if ok else 'unavailable'} in {time.perf_counter() - start:.1f} s"
            )
        print()
    _print(collect(measure_gemm=not args.no_gemm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
