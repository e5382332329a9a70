"""NVMe offload of Adam's moments: step time of SwappedAdam against the disk it swaps to.

    OMP_NUM_THREADS=2 python benchmarks/bench_swap.py [--params 32M] [--rounds 3] [--dir /tmp]

A swapped step reads and writes both moments (8 + 8 bytes per parameter) and runs CPUAdam on
them; with reads ahead and writes behind, its time should approach that of the I/O alone. The
run measures, on the same file, buffers and thread pool (O_DIRECT where the filesystem allows):

- ``disk alone``: the moment bytes written, then read back, in 16 MiB requests four at a time,
  no compute and no pipeline: what the drive gives this pool;
- ``I/O alone``: read every chunk, then write every chunk back, no compute, one request in
  flight at a time per direction, as the swapper issues them: the disk's limit for this step;
- ``CPUAdam, moments in memory``: the compute alone;
- ``SwappedAdam``: the real step, for a few ``sub_group_size`` / ``buffer_count`` settings,
  with the compiled I/O pool and with the Python-thread fallback.

Reported: seconds per step (median over rounds), the effective bandwidth (16 bytes per
parameter / step time), and the ratio (I/O alone) / (swapped step): 1.0 means the compute is
hidden entirely behind the disk. Results go to stdout and ``benchmarks/results/swap_<date>.md``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from zengine.ops import CPUAdam  # noqa: E402
from zengine.ops.aio import AsyncIO, aligned_empty  # noqa: E402
from zengine.zero.swap import StateSwapper, SwappedAdam  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def _timed(fn, steps: int) -> float:
    fn()  # warm-up: first touch, first read of the file
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _swapped(param, directory, chunk, buffers, threads, depth, compiled) -> SwappedAdam:
    io = AsyncIO(1 << 20, threads, depth, use_kernel=compiled)
    return SwappedAdam.replacing(CPUAdam([param], **HYPER),
                                 lambda numels: StateSwapper(numels, directory, chunk, buffers, io))


def io_alone(opt: SwappedAdam) -> float:
    """Every chunk read then written back through the swapper's own buffers and pool, no compute."""
    sw = opt.swapper
    chunks = sw.chunks[0]

    def run():
        sw.stream(chunks, lambda c: False, lambda c, m, v: None)
    return run


def disk_alone(opt: SwappedAdam, request_bytes: int = 16 << 20, in_flight: int = 4):
    """The drive's own pace for the same bytes: write the whole moment region, then read it back,
    ``request_bytes`` per request with ``in_flight`` requests queued (no pipeline, no compute)."""
    sw = opt.swapper
    total = sw.file.size
    bufs = [aligned_empty(request_bytes // 4) for _ in range(in_flight)]

    def run():
        for write in (True, False):
            pending = []
            for k, off in enumerate(range(0, total - total % request_bytes, request_bytes)):
                if len(pending) == in_flight:
                    pending.pop(0).wait()
                buf = bufs[k % in_flight]
                pending.append(sw.io.write(buf, sw.file, off) if write else sw.io.read(buf, sw.file, off))
            for r in pending:
                r.wait()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="32M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    args = ap.parse_args()
    n = _size(args.params)
    torch.manual_seed(0)
    param = torch.randn(n)
    param.grad = torch.randn(n) * 1e-3
    # (sub_group_size, buffer_count, aio.thread_count, aio.queue_depth, compiled pool); the first is the default
    settings = [(1 << 22, 4, 1, 8, True), (1 << 24, 4, 1, 8, True), (1 << 22, 4, 1, 1, True), (1 << 22, 4, 1, 2, True),
                (1 << 22, 2, 1, 8, True), (1 << 22, 4, 1, 8, False)]
    rows: dict[str, list[float]] = {}
    plain = CPUAdam([param], **HYPER)
    for _ in range(args.rounds):
        rows.setdefault("CPUAdam, moments in memory", []).append(_timed(plain.step, args.steps))
        for chunk, buffers, threads, depth, compiled in settings:
            opt = _swapped(param, args.dir, chunk, buffers, threads, depth, compiled)
            opt.step()  # the moments exist on disk from here on
            label = (f"sub_group {chunk >> 20}M, {buffers} buffers, {threads}x{depth} blocks in flight, "
                     f"{'compiled pool' if compiled else 'Python threads'}")
            if (chunk, buffers, threads, depth, compiled) == settings[0]:  # once per round: the drive, same pool
                rows.setdefault("disk alone (16 MiB requests, 4 queued, 8 blocks in flight)", []).append(
                    _timed(disk_alone(opt), args.steps))
            rows.setdefault(f"I/O alone ({label})", []).append(_timed(io_alone(opt), args.steps))
            rows.setdefault(f"SwappedAdam ({label})", []).append(_timed(opt.step, args.steps))
            direct = opt.swapper.file.direct
            opt.swapper.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    disk = next(k for k in med if k.startswith("disk alone"))
    lines = [f"# NVMe swap of Adam's moments, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"- {n / 1e6:.1f}M fp32 parameters, moments {2 * 4 * n / 2**20:.0f} MiB on {args.dir} "
             f"({'O_DIRECT' if direct else 'page cache'}); torch threads {torch.get_num_threads()}; "
             f"rounds {args.rounds} x {args.steps} steps, medians", "",
             "| contender | s/step | GB/s moved (16 B/param) | I/O alone / step |", "|---|---|---|---|"]
    for k, v in med.items():
        ratio = ""
        if k.startswith("SwappedAdam"):
            ratio = f"{med['I/O alone' + k[len('SwappedAdam'):]] / v:.2f}"
        moved = f"{16 * n / v / 1e9:.2f}" if not k.startswith("CPUAdam") else "-"
        if k.startswith("SwappedAdam"):
            ratio += f" (disk alone / step {med[disk] / v:.2f})"
        lines.append(f"| {k} | {v:.3f} | {moved} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = REPO / "benchmarks" / "results" / f"swap_{datetime.date.today():%Y%m%d}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
