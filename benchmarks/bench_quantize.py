"""ZeRO++'s blockwise codec on CPU: the compiled ``quantize`` op against its torch fallback, and the memory roof.

    OMP_NUM_THREADS=2 python benchmarks/bench_quantize.py [--numel 64M] [--rounds 3] [--out FILE]

For fp32 and bf16 inputs of ``--numel`` elements, int8 and int4 codes with a scale per 256 elements:

- ``quantize``: values -> codes + scales (reads the input, writes the codes and scales);
- ``dequantize``: codes + scales -> values of the input dtype (reads codes and scales, writes the values);
- ``sum of 4 rows``: the qgZ receive side, four ranks' codes decoded and added in fp32 into one fp32 row of
  ``numel / 4`` (reads four rows of codes, writes one row).

The figure is GB/s of those bytes (1e9 bytes per second) from the best of ``--rounds`` runs, for the kernel
(``zengine.ops.quantize``'s compiled path, the widest SIMD path of this CPU) and the torch fallback (the same
operations as torch ops, what a failed build or ``ZENGINE_DISABLE_OPS=quantize`` runs). The memory roof
is measured with the same threads on buffers of the same size, right before each kernel's timing (bandwidth
drifts on a shared machine): torch's ``copy_`` of the fp32 input (read + write); the kernel is quoted as a
fraction of the roof next to it. ../shared/MEASURED.md has the reference machine's figures. The markdown
table goes to stdout and to ``benchmarks/results/quantize_<date>.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch

from common import REPO, cpu_line, now, result_path, write_result

sys.path.insert(0, str(REPO))

from bench_adam import parse_size  # noqa: E402
from zengine.ops import load_op, simd_path  # noqa: E402
from zengine.ops import quantize as codec  # noqa: E402


def best_seconds(fn: Callable[[], object], rounds: int) -> float:
    """The fastest of ``rounds`` timed calls, after one untimed call (page faults, lazy set-up)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(numel: int, rounds: int) -> list[tuple[str, float, float | None, float]]:
    """Rows of (case, torch GB/s, kernel GB/s, copy_ roof GB/s measured just before the kernel)."""
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(numel, generator=gen)
    dst = torch.empty_like(x32)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype).view(1, -1)
        for bits in (8, 4):
            ncodes, blocks = codec.code_columns(numel, bits)
            codes = torch.empty(1, ncodes, dtype=torch.int8 if bits == 8 else torch.uint8)
            scales = torch.empty(1, blocks)
            out = torch.empty_like(x)
            coded = ncodes + 4 * blocks
            name = f"{str(dtype).split('.')[-1]} int{bits}"
            cases = [
                (
                    f"quantize {name}",
                    x.nbytes + coded,
                    lambda: codec.quantize_blocks(x, bits, codes=codes, scales=scales),
                ),
                (
                    f"dequantize {name}",
                    coded + out.nbytes,
                    lambda: codec.dequantize_blocks(codes, scales, numel, out, bits),
                ),
            ]
            if dtype == torch.float32:
                four_codes, four_scales = codes.view(4, -1), scales.view(4, -1)  # four ranks' rows
                total = torch.empty(numel // 4)
                cases.append(
                    (
                        f"sum of 4 rows int{bits}",
                        coded + total.nbytes,
                        lambda: codec.dequantize_sum(
                            four_codes, four_scales, numel // 4, total, bits
                        ),
                    )
                )
            for case, nbytes, fn in cases:
                roof = 2 * x32.nbytes / best_seconds(lambda: dst.copy_(x32), rounds) / 1e9
                kernel = (
                    nbytes / best_seconds(fn, rounds) / 1e9
                    if load_op("quantize") is not None
                    else None
                )
                real_load = codec.load_op
                codec.load_op = lambda name: (
                    None
                )  # the torch fallback, as where the op cannot be built
                try:
                    fallback = nbytes / best_seconds(fn, max(1, rounds // 2)) / 1e9
                finally:
                    codec.load_op = real_load
                rows.append((case, fallback, kernel, roof))
                print(
                    f"{case}: torch {fallback:.2f} GB/s, kernel {kernel or float('nan'):.2f} GB/s",
                    file=sys.stderr,
                )
    return rows


def render(rows, meta: dict[str, str]) -> str:
    """The markdown report."""
    lines = ["# ZeRO++ blockwise codec on CPU: compiled op against the torch fallback", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [
        "",
        "| case | torch GB/s | kernel GB/s | kernel / torch | copy_ roof GB/s | kernel / roof |",
        "|---|---|---|---|---|---|",
    ]
    for case, fallback, kernel, roof in rows:
        if kernel is None:
            lines.append(f"| {case} | {fallback:.2f} | n/a | n/a | {roof:.1f} | n/a |")
        else:
            lines.append(
                f"| {case} | {fallback:.2f} | {kernel:.2f} | {kernel / fallback:.1f}x | {roof:.1f} | "
                f"{kernel / roof:.2f} |"
            )
    lines += [
        "",
        "GB/s counts the bytes each case must move (input + codes + scales, or codes + scales + output);",
        "the copy_ roof counts its read and its write, the same way.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--numel", default="64M", help="elements per input (K/M/G suffixes); a multiple of 1024"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or None
    )
    parser.add_argument(
        "--out", default=None, help="markdown file (default benchmarks/results/quantize_<date>.md)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = parse_size(args.numel)
    if numel % 1024:
        parser.error("--numel must be a multiple of 1024 (four rows of whole blocks)")
    meta = {
        "date": now(),
        "machine": cpu_line(),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "SIMD path": str(simd_path()),
        "elements": f"{numel:,}",
        "rounds": str(args.rounds),
    }
    table = render(measure(numel, args.rounds), meta)
    print(table)
    write_result(table, result_path(None, "quantize"), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
