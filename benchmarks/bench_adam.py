"""Adam step throughput on CPU: zengine's CPUAdam against torch and DeepSpeed, and the roofline.

    OMP_NUM_THREADS=2 python benchmarks/bench_adam.py [--sizes 1M,16M,128M] [--rounds 3]

For each size (fp32 parameters in one tensor) every contender steps the same parameter and
gradient; the figure is parameters per second (G/s) from the median step time over
``--rounds`` rounds (the contenders alternate within a round). Memory bandwidth drifts on a
shared machine, so each contender's block of timed steps is preceded by a block of roofline
passes, and contenders are compared by their fraction of the roofline. Contenders:

- ``zengine CPUAdam``: AdamW mode and Adam (L2) mode, weight decay 0.01.
- ``torch AdamW`` / ``Adam``: default (single-tensor), ``foreach=True`` and ``fused=True``.
- ``DeepSpeedCPUAdam``: when ``import deepspeed`` works (``DS_ACCELERATOR=cpu``); its first
  use JIT-builds DeepSpeed's cpu_adam op (about two minutes here), cached afterwards.
- ``roofline``: C loops with Adam's memory traffic and no arithmetic to speak of (read
  p, g, m, v; write p, m, v: 16 + 12 = 28 bytes per parameter), plain and with software
  prefetch, built with the system compiler (``-O3 -march=native -fopenmp``) and run with
  the same threads on tensors of the same size; the faster of the two is the
  memory-bandwidth limit of this machine for an fp32 Adam step.
- bf16 copy-out: ``CPUAdam.step_with_copy`` writing a bf16 copy of the parameters in the
  same pass, against torch fused AdamW followed by a separate ``bf16.copy_(param)``.

The markdown table goes to stdout and to ``benchmarks/results/adam_<date>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from common import REPO, now, result_path, write_result  # noqa: E402

sys.path.insert(0, str(REPO))

from zengine.ops import CPUAdam, simd_path  # noqa: E402

BYTES_PER_PARAM = 28  # fp32 Adam: read p, g, m, v; write p, m, v
LR, WEIGHT_DECAY = 1e-3, 0.01

_ROOFLINE_C = r"""
#include <stdint.h>
/* Adam's memory traffic with trivial arithmetic: 16 bytes read, 12 written per element. */
void adam_traffic(float* restrict p, const float* restrict g, float* restrict m,
                  float* restrict v, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
  }
}
/* The same with software prefetch 12 lines ahead, as the zengine kernel does. */
void adam_traffic_prefetch(float* restrict p, const float* restrict g, float* restrict m,
                           float* restrict v, int64_t n, int threads) {
  const int64_t lines = n / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t line = 0; line < lines; ++line) {
    const int64_t b = line * 16;
    __builtin_prefetch(p + b + 192, 1, 3);
    __builtin_prefetch(g + b + 192, 0, 3);
    __builtin_prefetch(m + b + 192, 1, 3);
    __builtin_prefetch(v + b + 192, 1, 3);
    for (int64_t i = b; i < b + 16; ++i) {
      const float gi = g[i];
      p[i] += gi;
      m[i] += gi;
      v[i] += gi;
    }
  }
  for (int64_t i = lines * 16; i < n; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}
"""


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def build_roofline(workdir: Path) -> Callable[..., float] | None:
    """Compile the traffic loops with the system C compiler; None if there is none.

    The returned function runs both loops on (p, g, m, v) and returns the faster one's seconds.
    """
    src, lib = workdir / "roofline.c", workdir / "roofline.so"
    src.write_text(_ROOFLINE_C)
    cc = os.environ.get("CC", "cc")
    try:
        subprocess.run(
            [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"roofline probe not built ({err}); skipping it", file=sys.stderr)
        return None
    library = ctypes.CDLL(str(lib))
    loops = [library.adam_traffic, library.adam_traffic_prefetch]
    for fn in loops:
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int]
        fn.restype = None

    def run(p, g, m, v) -> float:
        best = float("inf")
        for fn in loops:
            start = time.perf_counter()
            fn(
                p.data_ptr(),
                g.data_ptr(),
                m.data_ptr(),
                v.data_ptr(),
                p.numel(),
                torch.get_num_threads(),
            )
            best = min(best, time.perf_counter() - start)
        return best

    return run


def deepspeed_cpu_adam():
    """DeepSpeed's CPU Adam class and version, or (None, reason)."""
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as err:  # noqa: BLE001 - any import failure means: not available
        return None, f"import deepspeed failed: {err.__class__.__name__}: {err}"
    return DeepSpeedCPUAdam, deepspeed.__version__


class Contender:
    """One way of taking an Adam step over (param, grad); ``make`` builds fresh state."""

    def __init__(self, name: str, make: Callable[[torch.Tensor], Callable[[], None]]):
        self.name = name
        self.make = make


def optimizer_contender(name: str, factory: Callable[[list], torch.optim.Optimizer]) -> Contender:
    def make(param):
        opt = factory([param])
        return opt.step

    return Contender(name, make)


TORCH_KINDS = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "default": {"foreach": False},
}


def contenders(ds_cls) -> list[Contender]:
    """AdamW then Adam with L2: zengine's CPUAdam, torch's three implementations and, when given,
    DeepSpeedCPUAdam (after torch's fused AdamW; right after CPUAdam for Adam)."""
    out = []
    for adamw, mode, torch_cls in (
        (True, "AdamW", torch.optim.AdamW),
        (False, "Adam, L2", torch.optim.Adam),
    ):
        group = [
            optimizer_contender(
                f"zengine CPUAdam ({mode})",
                lambda ps, a=adamw: CPUAdam(ps, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=a),
            )
        ]
        group += [
            optimizer_contender(
                f"torch {torch_cls.__name__} {kind}",
                lambda ps, c=torch_cls, kw=kw: c(ps, lr=LR, weight_decay=WEIGHT_DECAY, **kw),
            )
            for kind, kw in TORCH_KINDS.items()
        ]
        if ds_cls is not None:
            group.insert(
                2 if adamw else 1,
                optimizer_contender(
                    f"DeepSpeedCPUAdam ({mode})",
                    lambda ps, a=adamw: ds_cls(ps, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=a),
                ),
            )
        out += group
    return out


def copy_out_contenders() -> list[Contender]:
    def ours(param):
        out = torch.empty_like(param, dtype=torch.bfloat16)
        opt = CPUAdam([param], lr=LR, weight_decay=WEIGHT_DECAY)
        return lambda: opt.step_with_copy({param: out})

    def torch_then_copy(param):
        out = torch.empty_like(param, dtype=torch.bfloat16)
        opt = torch.optim.AdamW([param], lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        def step():
            opt.step()
            out.copy_(param)

        return step

    return [
        Contender("zengine CPUAdam + bf16 copy-out (one pass)", ours),
        Contender("torch AdamW fused, then bf16 .copy_", torch_then_copy),
    ]


def steps_for(n: int) -> int:
    return max(5, min(30, (64 << 20) // max(n, 1)))


@dataclass
class Samples:
    """Step times of one contender, and per block of steps its roofline fraction."""

    seconds: list[float] = field(default_factory=list)
    roofline_ratio: list[float] = field(
        default_factory=list
    )  # median roofline / median step, per block

    def rate(self, n: int) -> float:
        return n / statistics.median(self.seconds) / 1e9

    def fraction(self) -> float | None:
        return statistics.median(self.roofline_ratio) if self.roofline_ratio else None


ROOFLINE = "roofline (C loop, 28 B/param)"


def measure(
    sizes: list[int], rounds: int, ds_cls, include_slow: bool
) -> dict[str, dict[int, Samples]]:
    """Step times per contender per size. Each block of a contender's steps follows a block
    of roofline passes of the same length, so its fraction of the roofline is immune to the
    bandwidth drifting during the run (blocks, not single steps, so that data which fits in
    the cache stays there)."""
    results: dict[str, dict[int, Samples]] = {ROOFLINE: {}}
    roofline = build_roofline(Path(tempfile.mkdtemp(prefix="zengine_roofline_")))
    for n in sizes:
        gen = torch.Generator().manual_seed(0)
        param = torch.randn(n, generator=gen)
        param.grad = torch.randn(n, generator=gen)
        probe = [param.detach().clone(), torch.zeros(n), torch.zeros(n)] if roofline else None
        cands = contenders(ds_cls) + copy_out_contenders()
        if not include_slow and n > (16 << 20):
            cands = [c for c in cands if "default" not in c.name]
        for _ in range(rounds):
            for cand in cands:
                steps = steps_for(n) if "default" not in cand.name else 3
                roof = (
                    [roofline(probe[0], param.grad, probe[1], probe[2]) for _ in range(steps + 1)][
                        1:
                    ]
                    if roofline
                    else []
                )
                step = cand.make(param)
                times = time_steps(step, steps)
                del step
                samples = results.setdefault(cand.name, {}).setdefault(n, Samples())
                samples.seconds += times
                if roof:
                    results[ROOFLINE].setdefault(n, Samples()).seconds.extend(roof)
                    samples.roofline_ratio.append(
                        statistics.median(roof) / statistics.median(times)
                    )
            print(f"  {n:>11,d} params: round done", file=sys.stderr, flush=True)
        del probe
    if not results[ROOFLINE]:
        del results[ROOFLINE]
    return results


def time_steps(step: Callable[[], None], steps: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup`` untimed ones (the first allocates state)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def render(results: dict[str, dict[int, Samples]], sizes: list[int], meta: dict[str, str]) -> str:
    label = {n: (f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n:,d}") for n in sizes}
    lines = [f"# CPU Adam step throughput, {meta['date']}", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items() if key != "date"]
    lines += [
        "",
        "G params/s from the median step time over all rounds. In brackets: fraction of the "
        "roofline, the median over rounds of (median roofline pass / median step) with the "
        "roofline passes taken just before each contender's steps.",
        "",
    ]
    lines += [
        "| contender | " + " | ".join(label[n] for n in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for name, by_size in results.items():
        cells = []
        for n in sizes:
            samples = by_size.get(n)
            if samples is None:
                cells.append("-")
            elif name == ROOFLINE:
                rate = samples.rate(n)
                cells.append(f"{rate:.3f} ({rate * BYTES_PER_PARAM:.1f} GB/s)")
            else:
                fraction = samples.fraction()
                cells.append(
                    f"{samples.rate(n):.3f}"
                    + (f" ({fraction:.0%})" if fraction is not None else "")
                )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    big = max(sizes)

    def fraction(name):
        samples = results.get(name, {}).get(big)
        return samples.fraction() if samples else None

    def ratio(a, b):
        fa, fb = fraction(a), fraction(b)
        return f"{fa / fb:.2f}" if fa and fb else "n/a"

    ours = "zengine CPUAdam (AdamW)"
    lines += [
        "",
        f"Targets at {label[big]} (ratios of roofline fractions, so drift cancels):",
        "- zengine AdamW / roofline (target >= 0.95): "
        + (f"{fraction(ours):.2f}" if fraction(ours) else "n/a"),
        f"- zengine AdamW / torch AdamW fused (target >= 1.0): {ratio(ours, 'torch AdamW fused')}",
        f"- zengine AdamW / DeepSpeedCPUAdam AdamW (target >= 1.1): {ratio(ours, 'DeepSpeedCPUAdam (AdamW)')}",
        f"- zengine Adam / DeepSpeedCPUAdam Adam (target >= 1.1): "
        f"{ratio('zengine CPUAdam (Adam, L2)', 'DeepSpeedCPUAdam (Adam, L2)')}",
        f"- bf16 copy-out, one pass / torch fused + .copy_ (target >= 1.2): "
        f"{ratio('zengine CPUAdam + bf16 copy-out (one pass)', 'torch AdamW fused, then bf16 .copy_')}",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="1M,16M,128M", help="comma list of parameter counts (K/M/G suffixes)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or None
    )
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument(
        "--skip-slow",
        action="store_true",
        help="skip torch's default (single-tensor) Adam above 16M",
    )
    parser.add_argument(
        "--out", default=None, help="markdown file (default benchmarks/results/adam_<date>.md)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ds_cls, ds_version = (
        (None, "skipped (--no-deepspeed)") if args.no_deepspeed else deepspeed_cpu_adam()
    )
    if ds_cls is not None:  # build (or load) DeepSpeed's op before any timing
        start = time.perf_counter()
        ds_cls([torch.nn.Parameter(torch.zeros(16))])
        print(f"DeepSpeedCPUAdam ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    try:
        import cpuinfo

        cpu = cpuinfo.get_cpu_info().get("brand_raw", platform.processor())
    except ImportError:
        cpu = platform.processor()
    meta = {
        "date": now(),
        "machine": f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "deepspeed": ds_version,
        "zengine SIMD path": str(simd_path()),
        "rounds": str(args.rounds),
    }
    results = measure(sizes, args.rounds, ds_cls, include_slow=not args.skip_slow)
    table = render(results, sizes, meta)
    print(table)
    write_result(table, result_path(None, "adam"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
