"""Step time and per-rank memory of ZeRO implementations side by side, on CPU gloo ranks.

    python benchmarks/bench_zero.py [--warmup 3] [--steps 4] [--rounds 2] [--contenders ddp,zengine-2,...]
    python benchmarks/bench_zero.py --bf16    # zengine-2/3 in fp32, bf16 as torch runs it, bf16 with fp32 products

The model is ``zengine.models.bench20m()`` (about 21M parameters: 4 layers,
d_model 512, seq 128), trained in fp32 with AdamW on the same byte windows,
micro batch 4 per rank. Contenders:

- ``ddp``: torch DistributedDataParallel + torch.optim.AdamW(fused=True)
- ``zero-redundancy``: DDP + torch ZeroRedundancyOptimizer(AdamW, fused=True)
- ``zengine-0/1/2/3``: zengine with its config-built AdamW (torch's fused AdamW on CPU)
- ``fsdp2``: torch ``fully_shard`` (FSDP2) on each transformer block, then on the root,
  over a CPU device mesh (gloo), + torch.optim.AdamW(fused=True) on the DTensor parameters
- ``deepspeed-1/2/3``: DeepSpeed ZeRO with DS_ACCELERATOR=cpu, given the same torch
  fused AdamW as a client optimizer; skipped with a note when ``import deepspeed`` fails.
- ``zengine-2/3-bf16-native`` and ``-bf16-fp32mm``: zengine in bf16 with ``bf16.cpu_matmul`` "native"
  (torch's bf16 GEMM, emulated on CPUs without bf16 instructions) and "fp32" (nn.Linear's products in
  fp32, bf16 in and out). ``--bf16`` runs them beside zengine-2/3 in fp32 and adds a table of step,
  forward+backward and optimizer seconds against fp32 (report ``zero_bf16_<date>.md``, with the CPU).

zengine-3 and deepspeed-3 get the same stage-3 settings (``STAGE3``: DeepSpeed's defaults).

Every contender runs in fresh processes (torch.multiprocessing spawn, one
process group each). With ``--rounds R`` the contenders run R times in
alternating order, and the step-time median is taken over every round's timed
steps, because absolute times drift on a shared machine. The table goes to
stdout and to ``benchmarks/results/zero_<date>.md``. The first DeepSpeed run on
a machine JIT-builds DeepSpeed's shared-memory comm op (about 100 s, cached in
~/.cache/torch_extensions afterwards).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
import traceback

import psutil
import torch
import torch.distributed as dist

from common import (
    REPO,
    command_line,
    cpu_line,
    deepspeed_contenders,
    join_group,
    mean_over_ranks,
    now,
    publish,
    rank_results,
    result_path,
    save_rank_result,
    slowest_rank,
)

sys.path.insert(0, str(REPO))

from zengine import models  # noqa: E402
from zengine.models import GPT, ByteWindows  # noqa: E402
from zero_contenders import (  # noqa: E402
    BETAS,
    BF16_SET,
    BUCKET,
    CONTENDERS,
    EPS,
    FORMULA_TEXT,
    LR,
    MB,
    MICRO_BATCH,
    STAGE3,
    WEIGHT_DECAY,
    batch_for,
    formula_bytes,
)


# -- one worker ----------------------------------------------------------------------------------
def worker(
    rank: int,
    world: int,
    port: int,
    name: str,
    warmup: int,
    steps: int,
    bucket: int,
    model_name: str,
    out_dir: str,
) -> None:
    result = {"rank": rank}
    try:
        join_group(
            rank, world, port, minutes=5
        )  # a failed peer times out rather than hangs the launcher
        if name.startswith(("zengine", "deepspeed")):
            __import__(name.split("-")[0])  # the library's own import is not the training's memory
        baseline_rss = psutil.Process().memory_info().rss
        torch.manual_seed(0)
        cfg = getattr(models, model_name)()
        model = GPT(cfg)
        numel = sum(p.numel() for p in model.parameters())
        dataset = ByteWindows(cfg.seq_len)
        trainer = CONTENDERS[name][0](model, bucket)
        times, cpu_times, fwd_bwd, state_bytes, gathered_numel = [], [], [], 0, 0
        loss = None
        for i in range(warmup + steps):
            x, y = batch_for(dataset, i, rank, world)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainer.forward_backward(x, y)
            t1, c1 = time.perf_counter(), time.process_time()
            if i == warmup + steps - 1:
                state_bytes = trainer.state_bytes()  # outside the timed spans
                gathered_numel = trainer.gathered_numel()
            t2, c2 = time.perf_counter(), time.process_time()
            trainer.optimizer_step()
            times.append(t1 - t0 + time.perf_counter() - t2)
            fwd_bwd.append(t1 - t0)
            cpu_times.append(c1 - c0 + time.process_time() - c2)
        # A step ends on a rank when its last collective does; take the slower rank's time per step.
        result.update(
            step_times=slowest_rank(times[warmup:]),
            cpu_times=slowest_rank(cpu_times[warmup:]),
            fwd_bwd_times=slowest_rank(fwd_bwd[warmup:]),
            final_loss=mean_over_ranks(loss.item()),
            numel=numel,
            state_bytes=state_bytes,
            gathered_numel=gathered_numel,
            note=trainer.note,
            baseline_rss=baseline_rss,
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc(limit=6)
    save_rank_result(out_dir, rank, result)


# -- the launcher --------------------------------------------------------------------------------
def run_contender(name: str, args: argparse.Namespace) -> list[dict]:
    return rank_results(
        worker, args.world, name, args.warmup, args.steps, args.bucket, args.model, label=name
    )


def per_rank(values) -> str:
    return "/".join(f"{v / MB:.0f}" for v in values)


def precision_table(ok: dict, median: dict) -> list[str]:
    """Per stage: fp32, bf16 native and bf16 with fp32 products side by side, seconds and ratios to fp32."""

    def part(name, key):
        return statistics.median(t for rs in ok[name] for t in rs[0][key])

    lines = [
        "| contender | step s | fwd+bwd s | optimizer s | step × fp32 | fwd+bwd × fp32 | CPU s/step "
        "| CPU × fp32 | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ok:
        fp32 = name.split("-bf16")[0]
        if (
            not name.startswith("zengine-")
            or fp32 not in ok
            or (name != fp32 and "-bf16-" not in name)
        ):
            continue
        fb, base_fb = part(name, "fwd_bwd_times"), part(fp32, "fwd_bwd_times")
        cpu, base_cpu = part(name, "cpu_times"), part(fp32, "cpu_times")
        lines.append(
            f"| {name} | {median[name]:.3f} | {fb:.3f} | {median[name] - fb:.3f} | "
            f"{median[name] / median[fp32]:.2f} | {fb / base_fb:.2f} | {cpu:.3f} | {cpu / base_cpu:.2f} | "
            f"{ok[name][-1][0]['final_loss']:.4f} |"
        )
    return lines if len(lines) > 3 else []


def summarize(runs: dict[str, list[list[dict]]], args, notes: list[str]) -> str:
    """The markdown report: a header with the settings, the table, then notes."""
    numel = next((r[0]["numel"] for rs in runs.values() for r in rs if "numel" in r[0]), 0)
    ok = {
        n: rounds
        for n, rounds in runs.items()
        if not any("error" in r for rs in rounds for r in rs)
    }
    median = {
        n: statistics.median(t for rs in rounds for t in rs[0]["step_times"])
        for n, rounds in ok.items()
    }
    best = {
        n: min(statistics.median(rs[0]["step_times"]) for rs in rounds) for n, rounds in ok.items()
    }
    cpu = {
        n: statistics.median(t for rs in rounds for t in rs[0]["cpu_times"])
        for n, rounds in ok.items()
    }
    loss = {n: rounds[-1][0]["final_loss"] for n, rounds in ok.items()}
    table = [
        "| contender | median step (s) | × DDP | best round (s) | × DDP (best) | CPU s/step | × DDP (CPU) "
        "| peak RSS per rank (MB) | peak − RSS after imports (MB) | model states per rank (MB) "
        "| ZeRO formula (MB) | final loss | Δ loss vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines = []
    for name, rounds in runs.items():
        if name not in ok:
            error = next(r["error"] for rs in rounds for r in rs if "error" in r)
            table.append(f"| {name} | failed |" + " |" * 11)
            lines.append(f"- {name} failed:\n\n```\n{error.strip()}\n```")
            continue
        ratio = f"{median[name] / median['ddp']:.2f}" if "ddp" in ok else "n/a"
        best_ratio = f"{best[name] / best['ddp']:.2f}" if "ddp" in ok else "n/a"
        cpu_ratio = f"{cpu[name] / cpu['ddp']:.2f}" if "ddp" in ok else "n/a"
        delta = f"{loss[name] - loss['ddp']:+.1e}" if "ddp" in ok else "n/a"
        peak = per_rank(max(rs[r]["peak_rss"] for rs in rounds) for r in range(args.world))
        growth = per_rank(
            max(rs[r]["peak_rss"] - rs[r]["baseline_rss"] for rs in rounds)
            for r in range(args.world)
        )
        states = per_rank(rounds[-1][r]["state_bytes"] for r in range(args.world))
        kind = CONTENDERS[name][1]
        gathered = rounds[-1][0].get("gathered_numel", 0)
        formula = (
            f"{formula_bytes(kind, numel, args.world, gathered) / MB:.0f} ({FORMULA_TEXT[kind]})"
        )
        if kind == "bf16":
            formula = "n/a (the formulas are fp32's)"
        elif kind == "p+os+g":
            formula = formula[:-1] + f", {gathered:,} gathered)"
        table.append(
            f"| {name} | {median[name]:.3f} | {ratio} | {best[name]:.3f} | {best_ratio} | {cpu[name]:.3f} "
            f"| {cpu_ratio} | {peak} | {growth} "
            f"| {states} | {formula} | {loss[name]:.6f} | {delta} |"
        )
        lines.append(f"- {name}: model states = {rounds[-1][0]['note']}.")
    header = [
        f"# ZeRO step time and memory, {now()}",
        "",
        f"`{args.command}`",
        "",
        f"Model: {args.model}() GPT, Ψ = {numel:,} parameters, fp32 (bf16 where the name says); the same byte windows "
        "for every contender, "
        f"micro batch {MICRO_BATCH} × seq {getattr(models, args.model)().seq_len}; {args.world} gloo ranks × 1 thread. "
        f"AdamW lr {LR}, betas {BETAS}, eps {EPS}, weight_decay {WEIGHT_DECAY}; no clipping, no LR schedule. "
        "Every contender steps torch's fused AdamW: the torch peers and DeepSpeed get "
        "torch.optim.AdamW(fused=True), and zengine's config builder picks the same on CPU.",
        "",
        f"{args.warmup} warm-up + {args.steps} timed steps per round, {args.rounds} round(s) in alternating order, "
        "fresh processes each time. Step time: the slower rank's, median over all rounds' timed steps; "
        "best round: the lowest of the per-round medians (the least disturbed by other load). "
        "CPU s/step: the process's CPU time per step (all threads, slower rank), less sensitive than wall time "
        "to other load on the machine. Model states are counted between backward and the optimizer step, "
        "when gradients and optimizer states are both alive; formulas are the ZeRO paper's for fp32 Adam "
        "(4 bytes of parameter, 4 of gradient, 8 of Adam moments per element); with parameters partitioned "
        "too (zengine-3, fsdp2, deepspeed-3) it is 16Ψ/W plus 4 bytes per element of the parameters whole on "
        "the rank at that moment (\"gathered\": the small ones kept whole under "
        "stage3_param_persistence_threshold). Peak RSS: getrusage maxrss, "
        f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}. zengine and DeepSpeed: "
        f"reduce_bucket_size = allgather_bucket_size = {args.bucket:,} elements; DDP: its default buckets. "
        "zengine-3 and deepspeed-3: "
        + ", ".join(f"{k} {v:,}" for k, v in STAGE3.items())
        + " (DeepSpeed's "
        "defaults). fsdp2: fully_shard per transformer block and on the root, its defaults otherwise "
        "(fp32, reshard after forward).",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"load average at the end {os.getloadavg()[0]:.1f}. {cpu_line()}",
        "",
    ]
    side = precision_table(ok, median)
    if side:
        side = [
            "",
            "bf16 beside fp32 (medians over the timed steps; optimizer s = step − fwd+bwd; fp32 = the "
            "same stage in fp32; -native: torch's bf16 GEMM, -fp32mm: bf16.cpu_matmul \"fp32\"):",
            "",
        ] + side
    return "\n".join(header + table + side + ["", "Notes:", ""] + notes + lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="times every contender runs, interleaved"
    )
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    parser.add_argument(
        "--bucket",
        type=float,
        default=BUCKET,
        help="reduce_bucket_size and allgather_bucket_size (elements) for zengine and DeepSpeed",
    )
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="comma-separated subset of " + ", ".join(CONTENDERS),
    )
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results"), help="folder for the markdown table"
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="contenders "
        + ",".join(BF16_SET)
        + " (fp32 and bf16 side by side; overrides --contenders)",
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
        help="one step of the tiny model, one round: the harness works, the figures mean nothing",
    )
    args = parser.parse_args(argv)
    args.command = command_line("bench_zero.py", argv)
    if args.smoke:
        args.warmup, args.steps, args.rounds, args.model = 0, 1, 1, "tiny"
    if args.bf16:
        args.contenders = ",".join(BF16_SET)
    args.bucket = int(args.bucket)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")

    # Set before the workers start: freed blocks above 64 KiB go back to the OS, so RSS follows live memory;
    # DeepSpeed runs on its CPU accelerator.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names, notes = deepspeed_contenders(
        names,
        "ZeRO with a client torch fused AdamW. It keeps its fp32 master "
        "partition as a copy even for an fp32 model (+4Ψ/W over the formula), and "
        "its gradient bucket buffer is counted too. deepspeed-2-offload instead "
        "builds its own DeepSpeedCPUAdam from the config's optimizer section "
        "(offload_optimizer cpu).",
    )

    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            t0 = time.perf_counter()
            runs[name].append(run_contender(name, args))
            res = runs[name][-1][0]
            status = (
                "error"
                if "error" in res
                else f"median {statistics.median(res['step_times']):.3f} s"
            )
            print(
                f"round {r + 1}/{args.rounds} {name}: {status} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    publish(
        summarize(runs, args, notes), result_path(args.out, "zero_bf16" if args.bf16 else "zero")
    )


if __name__ == "__main__":
    main()
