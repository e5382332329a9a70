"""Checkpoint save and load throughput against the disk's sequential bandwidth, and the fp32 export's peak memory.

    python benchmarks/bench_checkpoint.py [--width 4096] [--layers 6] [--world 2] [--stage 1] [--rounds 3]
                                          [--export-layers 1,3,6] [--dir DIR]

The model is ``layers`` square ``nn.Linear(width, width)`` (6 x 4096: about
100M parameters), fp32, AdamW, one step taken so that the optimizer states
exist: a checkpoint is 12 bytes per parameter (master, exp_avg, exp_avg_sq).
``world`` gloo ranks at ZeRO ``stage`` save it ``rounds`` times and load it
back as many times, and saves it ``rounds`` times asynchronously (``async_save=True``: the
time until ``save_checkpoint`` returns is what the training step waits; the time until
``wait_for_checkpoint`` returns is when the checkpoint is published); each load starts cold (the checkpoint's pages are dropped
from the page cache with POSIX_FADV_DONTNEED). In the same run, one process
measures the disk's sequential bandwidth on a file of the checkpoint's size
in the same directory: written in 16 MiB blocks then fsynced, dropped from
the cache, read back (like ``dd bs=16M conv=fsync``).

Export: ``zengine-to-fp32`` runs in a fresh process on checkpoints of
``export-layers`` layers; its peak memory is getrusage's maxrss less the RSS
before the export starts (an upper bound on what the export added).
The table goes to stdout and to ``benchmarks/results/checkpoint_<date>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist
from torch import nn

from common import REPO, join_group, now, publish, result_path, spawn_ranks

sys.path.insert(0, str(REPO))

import zengine  # noqa: E402

MB = 1 << 20
BLOCK = 16 * MB


def drop_cache(path: str) -> None:
    """Evict a file's (clean) pages from the page cache, so the next read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def checkpoint_files(path: str) -> list[str]:
    return [os.path.join(path, n) for n in os.listdir(path)]


def disk_bandwidth(directory: str, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s of one sequential stream of ``nbytes``, with fsync, read cold."""
    path = os.path.join(directory, "dd.bin")
    block = os.urandom(BLOCK)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(0, nbytes, BLOCK):
            f.write(block)
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    drop_cache(path)
    buf = bytearray(BLOCK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read = time.perf_counter() - t0
    size = os.path.getsize(path)
    os.remove(path)
    return size / write, size / read


def make_engine(width: int, layers: int, stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    engine, *_ = zengine.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        },
    )
    engine.backward(engine(torch.randn(1, width)).pow(2).mean())
    engine.step()
    return engine


def rank_job(rank: int, world: int, port: int, args, out: str) -> None:
    join_group(rank, world, port)
    save_dir = os.path.join(args.dir, "main")
    engine = make_engine(args.width, args.layers, args.stage)
    saves, loads = [], []
    for r in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(save_dir, tag=f"round{r}")
        dist.barrier()
        saves.append(time.perf_counter() - t0)
    stalls, published = [], []
    for r in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(save_dir, tag=f"async{r}", async_save=True)
        stalls.append(
            time.perf_counter() - t0
        )  # what the step waits (the same on every rank: a collective)
        engine.wait_for_checkpoint()
        dist.barrier()
        published.append(time.perf_counter() - t0)
    for r in range(args.rounds):
        if rank == 0:
            for f in checkpoint_files(os.path.join(save_dir, f"round{r}")):
                drop_cache(f)
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(save_dir, tag=f"round{r}")
        dist.barrier()
        loads.append(time.perf_counter() - t0)
    del engine
    for (
        layers
    ) in args.export_layers:  # smaller checkpoints for the export's memory against model size
        if layers != args.layers:
            make_engine(args.width, layers, args.stage).save_checkpoint(
                os.path.join(args.dir, f"export{layers}")
            )
    if rank == 0:
        size = sum(os.path.getsize(f) for f in checkpoint_files(os.path.join(save_dir, "round0")))
        with open(out, "w") as f:
            json.dump(
                {
                    "saves": saves,
                    "loads": loads,
                    "bytes": size,
                    "stalls": stalls,
                    "published": published,
                },
                f,
            )
    dist.destroy_process_group()


MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    import psutil
    from zengine.checkpoint.export.to_fp32 import main
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    assert main(sys.argv[1:3]) == 0
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"before": before, "peak": peak, "seconds": seconds}))
""")


def export_peak(checkpoint_dir: str, output: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, checkpoint_dir, output],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    os.remove(output)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--export-layers", default="1,3,6")
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory)"
    )
    parser.add_argument(
        "--out", default=None, help="folder for the markdown table (default benchmarks/results)"
    )
    args = parser.parse_args(argv)
    args.export_layers = [int(x) for x in args.export_layers.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        args.dir = tmp
        out = os.path.join(tmp, "result.json")
        spawn_ranks(rank_job, args.world, args, out)
        with open(out) as f:
            res = json.load(f)
        write_bw, read_bw = disk_bandwidth(tmp, res["bytes"])
        exports = []
        for layers in args.export_layers:
            name = os.path.join("main", "round0") if layers == args.layers else f"export{layers}"
            path = os.path.join(tmp, name)
            exports.append((layers, export_peak(path, os.path.join(tmp, "export.pt"))))
    report(args, res, write_bw, read_bw, exports)


def report(args, res, write_bw, read_bw, exports) -> None:
    params = args.layers * (args.width * args.width + args.width)
    size = res["bytes"]
    save, load = statistics.median(res["saves"]), statistics.median(res["loads"])
    stall, published = statistics.median(res["stalls"]), statistics.median(res["published"])
    largest = args.width * args.width * 4
    lines = [
        f"# Checkpoint throughput and export memory, {now()}",
        "",
        f"Model: {args.layers} x nn.Linear({args.width}, {args.width}), {params:,} parameters, fp32, AdamW after one "
        f"step; {args.world} gloo ranks at ZeRO stage {args.stage}; checkpoint {size / MB:,.0f} MiB (12 bytes per "
        f"parameter: master, exp_avg, exp_avg_sq). Median of {args.rounds} saves and {args.rounds} cold loads "
        f"(page cache dropped before each). Disk: one sequential stream of the same size, 16 MiB blocks, fsync, "
        f"read cold, in the same directory and run.",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}.",
        "",
        "| operation | seconds | MiB/s | x disk sequential |",
        "|---|---|---|---|",
        f"| disk sequential write + fsync | {size / write_bw:.2f} | {write_bw / MB:,.0f} | 1.00 |",
        f"| save_checkpoint ({args.world} ranks) | {save:.2f} | {size / save / MB:,.0f} | "
        f"{size / save / write_bw:.2f} |",
        f"| save_checkpoint(async_save=True): the step's stall | {stall:.2f} | | {stall / save:.2f} x the sync save |",
        f"| save_checkpoint(async_save=True): until published | {published:.2f} | {size / published / MB:,.0f} | "
        f"{size / published / write_bw:.2f} |",
        f"| disk sequential read (cold) | {size / read_bw:.2f} | {read_bw / MB:,.0f} | 1.00 |",
        f"| load_checkpoint ({args.world} ranks, cold) | {load:.2f} | {size / load / MB:,.0f} | "
        f"{size / load / read_bw:.2f} |",
        "",
        f"Saves (s): {', '.join(f'{t:.2f}' for t in res['saves'])}; loads (s): "
        f"{', '.join(f'{t:.2f}' for t in res['loads'])}.",
        "",
        "## zengine-to-fp32: peak memory against model size",
        "",
        f"Largest tensor: {largest / MB:.0f} MiB (fp32 {args.width} x {args.width}). Extra = peak RSS (getrusage "
        f"maxrss) less RSS before the export, in a fresh process. Bound of the issue: 1.5 x largest + 200 MiB = "
        f"{(1.5 * largest + 200 * MB) / MB:.0f} MiB.",
        "",
        "| layers | parameters | fp32 model (MiB) | export extra RSS (MiB) | extra / largest tensor | export s |",
        "|---|---|---|---|---|---|",
    ]
    for layers, m in exports:
        n = layers * (args.width * args.width + args.width)
        extra = m["peak"] - m["before"]
        lines.append(
            f"| {layers} | {n:,} | {n * 4 / MB:,.0f} | {extra / MB:,.0f} | {extra / largest:.2f} | "
            f"{m['seconds']:.2f} |"
        )
    publish("\n".join(lines) + "\n", result_path(args.out, "checkpoint"))


if __name__ == "__main__":
    main()
