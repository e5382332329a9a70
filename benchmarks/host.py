"""What machine a benchmark ran on, for its report: the CPU, its bf16-relevant flags, and the variables that
cap the instruction sets torch's CPU kernels use (bench_zero.py, bench_infinity.py)."""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Optional

import torch


def cpu_line() -> str:
    """The CPU model, its bf16-relevant flags, and any variable that caps the ISA torch's kernels use."""
    from zengine.precision.cpu_matmul import choose_matmul_policy, cpu_flags

    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # the model name, and the family/model numbers a VM's name may hide
        info = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                    if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        model = f"{info.get('model name', model)}, family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()) or "none known"
    caps = " ".join(isa_caps())
    auto = choose_matmul_policy("auto", torch.bfloat16, torch.device("cpu"))
    return (f"CPU: {model} ({flags}){'; ISA capped by ' + caps if caps else ''}; bf16.cpu_matmul \"auto\" "
            f"here: {auto.mode}.")


def isa_caps() -> list[str]:
    """``NAME=value`` of the set variables that cap the instruction sets torch's CPU kernels use (set them to
    measure an AVX2 CPU's bf16 on a newer one: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
    MKL_ENABLE_INSTRUCTIONS=AVX2)."""
    return [f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
            if k in os.environ]


def write_result(text: str, default: Path, out: Optional[str] = None) -> Path:
    """Write a benchmark's table to ``out`` (or ``default``, under benchmarks/results/) and say where on stderr."""
    path = Path(out) if out else default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"written to {path}", file=sys.stderr)
    return path
