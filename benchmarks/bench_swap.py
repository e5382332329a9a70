"""NVMe offload of Adam's moments: SwappedAdam's step against the drive alone doing the same I/O.

    OMP_NUM_THREADS=2 python benchmarks/bench_swap.py [--params 32M] [--rounds 5] [--steps 3] [--dir /tmp]

A swapped step reads and writes both moments (8 + 8 bytes per parameter) and runs CPUAdam on
them; with reads ahead and writes behind its time should approach that of the drive doing the
same reads and writes with nothing else to do. One run measures, round after round (the order
of the contenders rotates each round; medians over rounds):

- ``drive at its best``: plain threads, one ``pread``/``pwrite`` per 8 MiB request, 16 in flight:
  the moment bytes written, then read back (no pool, no pattern, no compute);
- ``drive alone, the swapper's requests unmixed``: as above with the swapper's request size and
  number in flight: what mixing reads with writes costs, against the next line;
- ``drive alone, same pattern``: the requests of one SwappedAdam step, recorded from the swapper
  (the same sizes, offsets, buffers and file, submitted and waited for in the same order, so the
  same reads and writes overlap and the same number is in flight), replayed with plain threads,
  one ``pread``/``pwrite`` per request, no compute: what the drive gives this pattern;
- ``I/O alone``: the swapper's own ``stream`` through each pool with no compute;
- ``CPUAdam, moments in memory``: the compute alone;
- ``SwappedAdam``: the real step through ``AsyncIO`` at its defaults, at the settings it had
  before (1 MiB blocks, 8 in flight, one FIFO of blocks), at the engine's ``aio`` config
  defaults, and with the Python-thread fallback.

With ``--sweep``, also the swapper's I/O alone through pools of other block sizes and numbers of
blocks in flight (same file, same rotation).

Reported: seconds per step, GB/s (16 bytes per parameter / time), the pool's own figure from
``AsyncIO.stats()`` (bytes / seconds with I/O in flight), and the ratio (drive alone, same
pattern) / (contender): 1.0 means the step moves its bytes as fast as the drive does alone.
Results go to stdout and to ``--out`` (default ``benchmarks/results/swap_<date>.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import REPO, now, result_path, write_result

sys.path.insert(0, str(REPO))

from zengine.ops import CPUAdam  # noqa: E402
from zengine.ops.aio import AsyncIO, SwapFile, aligned_empty  # noqa: E402
from zengine.offload.state_swap import StateSwapper
from zengine.offload.swapped_adam import SwappedAdam  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
MiB = 1 << 20


def _size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return (
        int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)
    )


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def _raw(write: bool, fd: int, buf: memoryview, offset: int) -> None:
    """One request as one system call (retried only if the kernel moves less)."""
    done = 0
    while done < len(buf):
        part = buf[done:]
        moved = (
            os.pwritev(fd, [part], offset + done) if write else os.preadv(fd, [part], offset + done)
        )
        if moved <= 0:
            raise OSError(
                f"{'pwrite' if write else 'pread'} moved {moved} bytes at {offset + done}"
            )
        done += moved


class _Recorder:
    """Stands in for a swapper's AsyncIO for one step and notes every submit and wait, in order."""

    def __init__(self, io: AsyncIO):
        self.io, self.events = io, []

    def _note(self, write, tensor, file, offset):
        request = (self.io.write if write else self.io.read)(tensor, file, offset)
        index = sum(1 for e in self.events if e[0] == "submit")
        self.events.append(("submit", index, write, tensor, file, offset))
        recorder = self

        class Noted:
            def wait(self):
                recorder.events.append(("wait", index))
                request.wait()

            def done(self):
                return request.done()

        return Noted()

    def read(self, tensor, file, offset):
        return self._note(False, tensor, file, offset)

    def write(self, tensor, file, offset):
        return self._note(True, tensor, file, offset)


def record(opt: SwappedAdam) -> list:
    """The I/O of one ``opt.step()``: ("submit", i, write, tensor, file, offset) and ("wait", i) events."""
    sw = opt.swapper
    recorder = _Recorder(sw.io)
    sw.io = recorder
    try:
        opt.step()
    finally:
        sw.io = recorder.io
    waited = {e[1] for e in recorder.events if e[0] == "wait"}
    # requests nobody waited for inside stream (none today) are waited for at the end
    recorder.events += [
        ("wait", e[1]) for e in recorder.events if e[0] == "submit" and e[1] not in waited
    ]
    return recorder.events


def pattern_summary(events: list) -> str:
    sizes = sorted({e[3].numel() * e[3].element_size() for e in events if e[0] == "submit"})
    reads = sum(1 for e in events if e[0] == "submit" and not e[2])
    writes = sum(1 for e in events if e[0] == "submit" and e[2])
    return (
        f"{reads} reads + {writes} writes of {', '.join(f'{s / MiB:g}' for s in sizes)} MiB, "
        f"at most {max_in_flight(events)} in flight"
    )


def max_in_flight(events: list) -> int:
    live = peak = 0
    for e in events:
        live += 1 if e[0] == "submit" else -1
        peak = max(peak, live)
    return peak


def drive_same_pattern(events: list):
    """Replay ``events`` with one thread per request in flight and one system call per request."""
    pool = ThreadPoolExecutor(max_in_flight(events), thread_name_prefix="bench-drive")
    views = {}

    def run():
        futures = {}
        for e in events:
            if e[0] == "submit":
                _, i, write, tensor, file, offset = e
                buf = views.setdefault(i, _bytes(tensor))
                futures[i] = pool.submit(_raw, write, file.fd, buf, offset)
            else:
                futures.pop(e[1]).result()

    return run, pool


def drive_best(file: SwapFile, request: int = 8 * MiB, in_flight: int = 16):
    """Write ``file`` whole then read it back: ``request`` bytes per system call, ``in_flight`` at once.
    Returns (run, its threads, bytes per phase, {True: write seconds, False: read seconds per run})."""
    total = file.size - file.size % request
    bufs = [_bytes(aligned_empty(request // 4).fill_(1.0)) for _ in range(in_flight)]
    pool = ThreadPoolExecutor(in_flight, thread_name_prefix="bench-best")
    phases = {}

    def worker(write, k):
        for off in range(k * request, total, in_flight * request):
            _raw(write, file.fd, bufs[k], off)

    def run():
        for write in (True, False):
            t = time.perf_counter()
            for f in [pool.submit(worker, write, k) for k in range(in_flight)]:
                f.result()
            phases.setdefault(write, []).append(time.perf_counter() - t)

    return run, pool, total, phases


def io_alone(opt: SwappedAdam):
    """Every chunk read then written back through the swapper's own buffers and pool, no compute."""
    sw = opt.swapper

    def run():
        sw.stream(sw.chunks[0], lambda c: False, lambda c, m, v: None)

    return run


def sweep(opt: SwappedAdam, rounds: int, moved: int, restore: AsyncIO) -> list[str]:
    """The swapper's I/O alone (no compute) through pools of several block sizes and depths, one file."""
    K = 1 << 10
    shapes = [
        (256 * K, 16),
        (512 * K, 8),
        (512 * K, 16),
        (512 * K, 32),
        (MiB, 8),
        (MiB, 16),
        (2 * MiB, 16),
        (4 * MiB, 8),
        (8 * MiB, 4),
        (32 * MiB, 4),
    ]
    ios = {shape: AsyncIO(shape[0], 1, shape[1]) for shape in shapes}
    fifo = AsyncIO(MiB, 1, 8, priority=False)
    run = io_alone(opt)
    times: dict = {shape: [] for shape in [*shapes, "fifo"]}
    order = list(times)
    for r in range(-1, rounds):  # round -1: warm-up
        for shape in order[r % len(order) :] + order[: r % len(order)]:
            opt.swapper.io = fifo if shape == "fifo" else ios[shape]
            t = _timed(run, 1 if r < 0 else 2)
            if r >= 0:
                times[shape].append(t)
    opt.swapper.io = restore
    for io in [*ios.values(), fifo]:
        io.close()
    out = ["| swapper's I/O alone: block size x in flight | s/step | GB/s |", "|---|---|---|"]
    for shape, v in times.items():
        name = (
            "1024 KiB x 8, one FIFO (before)"
            if shape == "fifo"
            else f"{shape[0] >> 10} KiB x {shape[1]}, reads first"
        )
        out.append(
            f"| {name} | {statistics.median(v):.3f} | {moved / statistics.median(v) / 1e9:.2f} |"
        )
    return out


def _cpu_seconds() -> tuple[float, float, float]:
    """(seconds since boot of all CPUs busy, of this process's CPU time, wall clock): to tell
    how much of the machine other processes took during the run (they disturb the drive too)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
    t = os.times()
    return busy / tick, t.user + t.system, time.perf_counter()


def _timed(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="32M", help="fp32 parameters (moments: 8 bytes each)")
    ap.add_argument("--sub-group", default="4M", help="sub_group_size: elements per swapped chunk")
    ap.add_argument("--buffers", type=int, default=4, help="offload_optimizer.buffer_count")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--steps", type=int, default=3, help="timed steps per contender per round (median)"
    )
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time the swapper's I/O alone for several block sizes and numbers in flight",
    )
    ap.add_argument(
        "--out", default=None, help="markdown file (default benchmarks/results/swap_<date>.md)"
    )
    args = ap.parse_args(argv)
    n, chunk = _size(args.params), _size(args.sub_group)
    torch.manual_seed(0)
    param = torch.randn(n)
    param.grad = torch.randn(n) * 1e-3
    moved = 16 * n  # bytes a step reads and writes

    d = AsyncIO()
    defaults = f"{d.block_size >> 10} KiB blocks, {d.thread_count} in flight"
    d.close()
    # label -> the AsyncIO a SwappedAdam swaps through
    pools = {
        f"AsyncIO() defaults ({defaults}, reads first)": lambda: AsyncIO(),
        "before: 1 MiB blocks, 8 in flight, one FIFO": lambda: AsyncIO(MiB, 1, 8, priority=False),
        "aio config defaults (1 MiB blocks, 1x8 in flight), reads first": lambda: AsyncIO(
            MiB, 1, 8
        ),
        f"Python threads ({defaults}, reads first)": lambda: AsyncIO(use_kernel=False),
    }
    # One optimizer, one swap file, one set of buffers for every contender: only the pool changes.
    ios = {label: make() for label, make in pools.items()}
    first_io = next(iter(ios.values()))
    opt = SwappedAdam.replacing(
        CPUAdam([param], **HYPER),
        StateSwapper([param.numel()], args.dir, chunk, args.buffers, first_io),
    )
    opt.step()  # the moments exist on disk from here on
    sw = opt.swapper
    direct = sw.file.direct
    events = record(opt)  # the pattern is fixed by sub_group_size and buffer_count, not by the pool
    same, same_pool = drive_same_pattern(events)
    best, best_pool, best_total, best_phases = drive_best(sw.file)
    request = max(e[3].numel() * e[3].element_size() for e in events if e[0] == "submit")
    unmixed, unmixed_pool, _, _ = drive_best(sw.file, request, max_in_flight(events))
    plain = CPUAdam([param], **HYPER)

    same_label = "drive alone, same pattern (plain threads, 1 syscall per request, no compute)"
    best_label = "drive at its best (8 MiB requests, 16 in flight; all written, then all read)"
    unmixed_label = (
        f"drive alone, the swapper's requests unmixed ({request / MiB:g} MiB, {max_in_flight(events)} in "
        f"flight; all written, then all read)"
    )
    contenders = {
        best_label: (None, best),
        unmixed_label: (None, unmixed),
        same_label: (None, same),
        "CPUAdam, moments in memory": (None, plain.step),
    }
    for label, io in ios.items():
        contenders[f"I/O alone, no compute ({label})"] = (io, io_alone(opt))
        contenders[f"SwappedAdam ({label})"] = (io, opt.step)
    for io, fn in contenders.values():
        sw.io = io or first_io
        fn()  # warm-up
    rows: dict[str, list[float]] = {k: [] for k in contenders}
    busy: dict[str, list[float]] = {}
    start = _cpu_seconds()
    names = list(contenders)
    for r in range(args.rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            io, fn = contenders[k]
            sw.io = io or first_io
            before = sw.io.stats()
            rows[k].append(_timed(fn, args.steps))
            if io is not None:
                busy.setdefault(k, []).append((sw.io.stats() - before).gbps())
    end = _cpu_seconds()
    others = max(0.0, (end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2])
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio_to = med[same_label]
    w = statistics.median(best_phases[True][1:] or best_phases[True])
    rd = statistics.median(best_phases[False][1:] or best_phases[False])

    lines = [
        f"# NVMe swap of Adam's moments against the drive alone, {now()}",
        "",
        f"- {n / 1e6:.1f}M fp32 parameters: moments {8 * n / MiB:.0f} MiB on {args.dir} "
        f"({'O_DIRECT' if direct else 'page cache'}), {16 * n / MiB:.0f} MiB read + written per step; "
        f"sub_group_size {chunk}, buffer_count {args.buffers}; torch threads {torch.get_num_threads()}; "
        f"{os.cpu_count()} cores",
        f"- swapper's pattern per step: {pattern_summary(events)}",
        f"- drive at its best, separately: writes {best_total / w / 2**30:.2f} GiB/s, "
        f"reads {best_total / rd / 2**30:.2f} GiB/s",
        f"- {args.rounds} rounds x {args.steps} steps, contenders in rotating order; medians; other processes "
        f"kept {others:.2f} of {os.cpu_count()} cores busy meanwhile"
        f"{' (the figures are disturbed: run again on a quiet machine)' if others > 0.25 else ''}. "
        f"`{' '.join(['python benchmarks/bench_swap.py'] + (sys.argv[1:] if argv is None else argv))}`",
        "",
        "| contender | s/step | GB/s (16 B/param) | pool GB/s while busy | drive same pattern / this |",
        "|---|---|---|---|---|",
    ]
    for k, v in med.items():
        gbs = "-" if k.startswith("CPUAdam") else f"{moved / v / 1e9:.2f}"
        pool = f"{statistics.median(busy[k]):.2f}" if k in busy else ""
        ratio = f"{ratio_to / v:.2f}" if not k.startswith("CPUAdam") else ""
        lines.append(f"| {k} | {v:.3f} | {gbs} | {pool} | {ratio} |")
    lines.append("")
    for label in ios:  # the same round's drive figure against the same round's step: drift cancels
        per_round = [a / b for a, b in zip(rows[same_label], rows[f"SwappedAdam ({label})"])]
        lines.append(
            f"- SwappedAdam ({label}): {statistics.median(per_round):.2f} of the drive alone with the same "
            f"pattern, round by round ({min(per_round):.2f} to {max(per_round):.2f}); "
            f"{med[unmixed_label] / med[f'SwappedAdam ({label})']:.2f} of the same requests unmixed"
        )
    if args.sweep:
        lines += ["", *sweep(opt, args.rounds, moved, first_io)]
    text = "\n".join(lines) + "\n"
    print(text)
    write_result(text, result_path(None, "swap"), args.out)
    for io in ios.values():
        io.close()
    sw.file.close()
    for pool in (same_pool, best_pool, unmixed_pool):
        pool.shutdown()


if __name__ == "__main__":
    main()
