"""torch.compile's effect on a training step, side by side: eager vs compiled zengine, and compiled DDP.

    python benchmarks/bench_compile.py [--backend inductor] [--warmup 3] [--steps 5] [--rounds 1] [--paired]
                                       [--contenders ddp,ddp-compiled,zengine-2,zengine-2-compiled,...]

The model and data are zero_contenders.py's (``bench20m``: the main job's GPT at 21M parameters, fp32, AdamW,
micro batch 4 per rank, CPU gloo ranks). Contenders:

- ``ddp`` / ``ddp-compiled``: torch DistributedDataParallel, eager / ``torch.compile(ddp_model)``
  (DDP's optimizer splits the graph at its bucket boundaries so that reductions overlap backward);
- ``ddp-compiled+gather``: compiled DDP that also runs, before each forward, the collective stage 3 adds to
  DDP's traffic: ZeRO-3 moves 1.5x DDP's bytes, an all-gather of the parameters besides the gradients'
  reduction. Here it is that all-gather alone (zengine's collective, a broadcast per row on gloo, of every
  parameter's chunks, within one persistent buffer: no copy in or out, no fresh memory). Where communication
  is work on the compute cores, as on this CPU box, it is the least stage 3 can cost beyond DDP;
- ``fsdp2`` / ``fsdp2-compiled``: torch FSDP2 (``fully_shard`` per transformer block, then the root),
  eager / each block ``torch.compile``d before it is sharded, as torchtitan compiles: stage 3's own
  peer, which gathers and frees each block's parameters as zengine-3 does;
- ``zengine-S`` / ``zengine-S-compiled`` (S = 0, 2, 3): zengine at stage S, eager / ``engine.compile()``.
  At stage 3 every transformer block is a leaf (``set_z3_leaf_modules``), eager and compiled alike: one
  gather unit per block, compiled as one graph. ``zengine-S-compiled-autograd``: also compiled autograd
  (``engine.compile(compiled_autograd_enabled=True)``: the whole backward captured and compiled).
  zengine's collectives go through shared memory (``shared_memory``'s default "auto": the ranks share this
  host; ``zengine/distributed/shm.py``); ``zengine-S[-compiled]-gloo``: ``shared_memory.enabled`` false,
  gloo's loopback TCP. ``ddp-compiled+gather``'s all-gather takes whichever zengine uses on the group when
  it runs: shared memory once a zengine contender without ``-gloo`` has been built in the processes.

Each contender runs in fresh processes; with ``--rounds R`` all run R times in alternating order and the
median step time is over every round's timed steps (absolute times drift on a shared machine: compare the
ratios of one run). Reported: the median step time (slower rank; wall clock, and the CPU time the process
used, which other users of a shared machine disturb less), the time of the untimed first steps beyond
``warmup x median`` (compilation, mostly: zengine-3 compiles at its second step, after a first step run
eagerly), and peak resident memory per rank above the process's size after imports. The table goes to
stdout and to ``benchmarks/results/compile_<date>.md``.

``--paired`` instead builds every contender in the same processes and runs their steps in turn (the order
reversed every step), so that a slower minute of a shared machine slows all alike: reported per contender,
the median of its step's CPU (and wall) time over compiled DDP's step next to it (the first contender's
without ``ddp-compiled``). Peak memory and
compile times mean nothing there (the models share the processes): use the separate runs for those.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from common import (
    REPO,
    command_line,
    join_group,
    mean_over_ranks,
    publish,
    rank_results,
    result_path,
    save_rank_result,
    slowest_rank,
    spawn_ranks,
    today,
)

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from zero_contenders import (
    BUCKET,
    MB,
    batch_for,
    build_fsdp2,
    torch_adamw,
    torch_steps,
    zero_config,
)  # noqa: E402
from zengine import models  # noqa: E402
from zengine.models import GPT, ByteWindows  # noqa: E402

CONTENDERS = [
    "ddp",
    "ddp-compiled",
    "ddp-compiled+gather",
    "zengine-0-compiled",
    "zengine-2",
    "zengine-2-compiled",
    "fsdp2",
    "fsdp2-compiled",
    "zengine-3",
    "zengine-3-compiled",
]


def build(name: str, model: torch.nn.Module, backend: str):
    """(forward_backward(x, y) -> loss, optimizer_step()) of contender ``name``."""
    compiled = "-compiled" in name
    autograd = name.endswith("-autograd")  # zengine: engine.compile(compiled_autograd_enabled=True)
    if name.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET * 4 / MB)
        run = torch.compile(ddp, backend=backend) if compiled else ddp
        forward_backward, optimizer_step = torch_steps(run, torch_adamw(ddp.parameters()))
        if name.endswith("+gather"):
            gather = stage3_gather(list(model.parameters()))
            return (lambda x, y: (gather(), forward_backward(x, y))[1]), optimizer_step
        return forward_backward, optimizer_step
    if name.startswith("fsdp2"):
        if compiled:  # torchtitan's order: compile each block, then shard it (the hooks stay outside the graphs)
            for block in model.blocks:
                block.compile(backend=backend)
        trainer = build_fsdp2(model, BUCKET)
        return trainer.forward_backward, trainer.optimizer_step
    import zengine
    from zengine.models.gpt import Block

    stage = int(name.split("-")[1])
    if stage == 3:
        zengine.utils.set_z3_leaf_modules(
            model, [Block]
        )  # one gather unit (and one graph) per block
    config = zero_config(stage, BUCKET)
    if name.endswith(
        "-gloo"
    ):  # gloo's transport, not shared memory (the default where the ranks share a host)
        config["shared_memory"] = {"enabled": False}
    engine, *_ = zengine.initialize(model=model, config=config)
    if compiled:
        engine.compile(backend=backend, compiled_autograd_enabled=autograd)

    def forward_backward(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    return forward_backward, engine.step


def stage3_gather(params: list[torch.nn.Parameter]):
    """A function doing the collective stage 3 adds to DDP's once a step (``ddp-compiled+gather``): every
    parameter's chunks all-gathered, by rows, within one persistent buffer (no copy in or out)."""
    from zengine.distributed.collectives import all_gather_rows

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = torch.zeros(world, sum(-(-p.numel() // world) for p in params))  # [world, sum of chunks]
    return lambda: all_gather_rows(rows, rank)


def worker(
    rank: int, world: int, port: int, name: str, args: argparse.Namespace, out_dir: str
) -> None:
    result = {"rank": rank}
    try:
        join_group(rank, world, port, minutes=10)
        importlib.import_module("torch._dynamo")  # imports are not the training's memory
        if name.startswith("zengine"):
            importlib.import_module("zengine")
        baseline_rss = psutil.Process().memory_info().rss
        torch.manual_seed(0)
        cfg = getattr(models, args.model)()
        model = GPT(cfg)
        dataset = ByteWindows(cfg.seq_len)
        forward_backward, optimizer_step = build(name, model, args.backend)
        times, cpu_times = [], []
        loss = None
        for i in range(args.warmup + args.steps):
            x, y = batch_for(dataset, i, rank, world)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = forward_backward(x, y)
            optimizer_step()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        result.update(
            times=slowest_rank(times),
            cpu_times=slowest_rank(cpu_times),
            final_loss=mean_over_ranks(loss.item()),
            baseline_rss=baseline_rss,
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc(limit=8)
    save_rank_result(out_dir, rank, result)


def paired_worker(
    rank: int, world: int, port: int, names: list[str], args: argparse.Namespace, out_dir: str
) -> None:
    """Every contender in these processes, one step of each in turn; writes the step times (slower rank)."""
    join_group(rank, world, port, minutes=10)
    cfg = getattr(models, args.model)()
    dataset = ByteWindows(cfg.seq_len)
    steps = {}
    for name in names:
        torch.manual_seed(0)
        steps[name] = build(name, GPT(cfg), args.backend)
    cpu, wall, losses = ({n: [] for n in names} for _ in range(3))
    for i in range(args.warmup + args.steps):
        x, y = batch_for(dataset, i, rank, world)
        for name in names if i % 2 == 0 else names[::-1]:
            forward_backward, optimizer_step = steps[name]
            dist.barrier()  # each contender's step starts with both ranks ready
            t0, c0 = time.perf_counter(), time.process_time()
            loss = forward_backward(x, y)
            optimizer_step()
            if i >= args.warmup:
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - t0)
            losses[name] = loss.detach().double().clone()
    times = torch.tensor([cpu[n] for n in names] + [wall[n] for n in names], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    final = torch.stack([losses[n] for n in names])
    dist.all_reduce(final)
    if rank == 0:
        k = len(names)
        Path(out_dir, "paired.json").write_text(
            json.dumps(
                {
                    n: dict(
                        cpu=times[j].tolist(),
                        wall=times[k + j].tolist(),
                        loss=final[j].item() / world,
                    )
                    for j, n in enumerate(names)
                }
            )
        )
    dist.destroy_process_group()


def run_paired(names: list[str], args: argparse.Namespace) -> str:
    """The ``--paired`` table: each contender's step against compiled DDP's step beside it (or the first's)."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(paired_worker, args.world, names, args, out_dir)
        res = json.loads(Path(out_dir, "paired.json").read_text())
    first = "ddp-compiled" if "ddp-compiled" in names else names[0]
    base = res[first]
    rows = []
    for name in names:
        r = res[name]
        ratio = {
            k: statistics.median(a / b for a, b in zip(r[k], base[k])) for k in ("cpu", "wall")
        }
        rows.append(
            f"| {name} | {statistics.median(r['cpu']):.3f} | {statistics.median(r['wall']):.3f} | "
            f"{ratio['cpu']:.3f}x / {ratio['wall']:.3f}x | {r['loss']:.4f} |"
        )
    return (
        f"| contender | CPU s/step (median) | s/step (median, wall) | paired ratio to {first} (CPU / wall) "
        "| final loss |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def run_contender(name: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as cache:
        # a fresh inductor cache per run (the workers inherit it): every compile time is a whole compile, not a
        # cache hit on graphs an earlier contender compiled
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        return rank_results(worker, args.world, name, args, label=name)


def host_line(args: argparse.Namespace) -> str:
    return (
        f"Host: {platform.node()} ({os.cpu_count()} CPUs, shared), torch {torch.__version__}, backend "
        f"{args.backend}, W={args.world} gloo ranks (1 thread each), model {args.model} "
        f"({'21M parameters, ' if args.model == 'bench20m' else ''}fp32, AdamW, micro batch 4)"
    )


def summarize(runs: dict[str, list[list[dict]]], args: argparse.Namespace, command: str) -> str:
    rows, medians = [], {}
    for name, rounds in runs.items():
        errors = [r["error"] for results in rounds for r in results if "error" in r]
        if errors:
            rows.append(f"| {name} | failed: {errors[0].strip().splitlines()[-1]} | | | | | |")
            continue
        timed = [t for results in rounds for t in results[0]["times"][args.warmup :]]
        median = statistics.median(timed)
        cpu = statistics.median(
            [t for results in rounds for t in results[0]["cpu_times"][args.warmup :]]
        )
        medians[name] = (median, cpu)
        first = statistics.mean(sum(results[0]["times"][: args.warmup]) for results in rounds)
        peak = "/".join(f"{(r['peak_rss'] - r['baseline_rss']) / MB:.0f}" for r in rounds[-1])
        loss = rounds[-1][0]["final_loss"]
        compile_s = max(0.0, first - args.warmup * median)
        rows.append(
            f"| {name} | {median:.3f} | {cpu:.3f} | {{ratio_{name}}} | {compile_s:.1f} | {peak} | {loss:.4f} |"
        )
    table = "\n".join(rows)
    for name in runs:
        eager = name[: -len("-compiled")] if name.endswith("-compiled") else None
        parts = []
        for other in ("ddp-compiled", eager):
            if name in medians and other in medians and other != name:
                wall = medians[name][0] / medians[other][0]
                cpu = medians[name][1] / medians[other][1]
                parts.append(f"{wall:.2f}x / {cpu:.2f}x {other}")
        table = table.replace(f"{{ratio_{name}}}", ", ".join(parts))
    return (
        f"# torch.compile, side by side ({today()})\n\n"
        f"`{command}`\n\n"
        f"{host_line(args)}, {args.warmup} untimed + {args.steps} timed steps x {args.rounds} round(s).\n\n"
        "| contender | s/step (median, wall) | CPU s/step (median) | ratio (wall / CPU) | compile s (first steps beyond "
        "warmup x median) | peak RSS MB per rank | final loss |\n|---|---|---|---|---|---|---|\n"
        + table
        + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile backend of every compiled contender"
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps (compilation happens here)"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument(
        "--rounds", type=int, default=1, help="times every contender runs, interleaved"
    )
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset")
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results"), help="folder for the markdown table"
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="every contender in the same processes, steps in turn: ratios to ddp-compiled's steps",
    )
    parser.add_argument(
        "--model",
        default="bench20m",
        choices=["bench20m", "tiny"],
        help="zengine.models GPT config (tiny: the smoke run's)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the tiny model, one untimed and one timed step, "
        "torch.compile's eager backend: the harness works, the figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps, args.rounds, args.model, args.backend = 1, 1, 1, "tiny", "eager"
    names = args.contenders.split(",")
    command = command_line("bench_compile.py", argv)
    if args.paired:
        report = (
            f"# torch.compile, paired steps ({today()})\n\n`{command}`\n\n{host_line(args)}, "
            f"{args.warmup} untimed + {args.steps} timed steps, the contenders' steps in turn in the same "
            f"processes.\n\n" + run_paired(names, args)
        )
    else:
        runs: dict[str, list] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
                runs[name].append(run_contender(name, args))
        report = summarize(runs, args, command)
    publish(report, result_path(args.out, "compile"))


if __name__ == "__main__":
    main()
