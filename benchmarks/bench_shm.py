"""Collectives of CPU ranks on one host: gloo's transport against shared memory (``zengine/distributed/shm.py``).

    python benchmarks/bench_shm.py [--world 2] [--sizes 1,16,84] [--repeats 9]

For each size (MiB of the whole buffer) and each collective zengine sends through the transport (the
all-gather by rows of stage 3's and the post-step gathers, the all-reduce of stages 0-2's gradients,
stage 3's reduce-scatter of its [world, n] gradient buckets; gloo has no fast reduce-scatter, so zengine's
gloo path all-reduces there), the median over the repeats (the first two left out) of the slowest rank's wall
time and of the CPU time its process used (gloo's threads included). Each rank runs one compute thread, as
the training benchmarks do. Prints a markdown table and writes it to ``benchmarks/results/shm_<date>.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common import REPO, join_group, publish, result_path, spawn_ranks, today

sys.path.insert(0, str(REPO))


def _time(fn, repeats: int) -> tuple[float, float]:
    wall, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    both = torch.tensor(
        [statistics.median(wall[2:]), statistics.median(cpu[2:])], dtype=torch.float64
    )
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the slowest rank's
    return both[0].item(), both[1].item()


def worker(
    rank: int, world: int, port: int, sizes: list[int], repeats: int, out: str, piece: int
) -> None:
    from zengine.distributed import collectives, shm

    join_group(rank, world, port)
    rows_out = []
    for mib in sizes:
        n = mib * 2**20 // 4 // world
        buf = torch.randn(world, n)  # [world, n] fp32
        cases = {
            "all-gather by rows": lambda: collectives.all_gather_rows(buf, rank),
            "all-reduce": lambda: collectives.all_reduce_sum(buf),
            # gloo: an all-reduce whose row is kept (zengine's way there); shared memory: each rank its row
            "reduce-scatter of rows": lambda: [
                w.wait() for w in collectives.reduce_scatter_rows(buf, rank)[0]
            ],
        }
        for name, fn in cases.items():
            gloo = _time(fn, repeats)
            transport = shm.install(None, piece)
            shared = _time(fn, repeats)
            shm.uninstall(transport)
            rows_out.append(
                f"| {mib} | {name} | {gloo[0] * 1e3:.1f} / {gloo[1] * 1e3:.1f} | "
                f"{shared[0] * 1e3:.1f} / {shared[1] * 1e3:.1f} | {gloo[1] / shared[1]:.2f}x |"
            )
    if rank == 0:
        Path(out).write_text("\n".join(rows_out) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--sizes", default="1,16,84", help="MiB of the whole buffer, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--piece",
        type=float,
        default=8.0,
        help="MiB each rank moves per sync (shared_memory.piece_size)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.md")
        spawn_ranks(worker, args.world, sizes, args.repeats, out, int(args.piece * 2**20))
        rows = Path(out).read_text()
    command = "python benchmarks/bench_shm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (
        f"# Collectives through gloo and through shared memory ({today()})\n\n`{command}`\n\n"
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, W={args.world} gloo ranks (1 thread each), fp32, "
        f"{args.piece:g} MiB pieces; times in ms, slowest rank, median of {args.repeats - 2}.\n\n"
        "| MiB | collective | gloo wall / CPU | shared memory wall / CPU | CPU ratio |\n|---|---|---|---|---|\n"
        + rows
    )
    publish(text, result_path(args.out, "shm"))


if __name__ == "__main__":
    main()
