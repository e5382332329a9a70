"""Stage 3's gather units at DeepSpeed's defaults: collectives per step and step time, side by side.

    python benchmarks/bench_gather_units.py [--world 2] [--model bench20m] [--warmup 3] [--steps 5] [--rounds 2]

Every contender trains the main job's GPT (``zengine.models.<model>``, fp32, AdamW) on the same byte
windows with the same stage-3 settings (``zero_contenders.STAGE3``: DeepSpeed's defaults):

- ``auto``: zengine as configured by a DeepSpeed user (``stage3_gather_units`` "auto", the default):
  consecutive modules of a block gathered as one collective once the first step's order is known;
- ``module``: one collective per module (``stage3_gather_units: "module"``, DeepSpeed's way);
- ``leaf-blocks``: one collective per transformer block because the user named each block a leaf
  (``set_z3_leaf_modules``), the FSDP2-like units the issue measures against;
- ``fsdp2``: torch ``fully_shard`` per block, then the root (its collectives are not counted here).

Reported: the parameter all-gathers a training step issues (after the first, recording step; zengine's
own count of the collectives it started), the median step time of the slower rank over every round's
timed steps (contenders alternate within a round, as times drift on a shared machine), and the ratio
to ``leaf-blocks``. Writes ``benchmarks/results/gather_units_<date>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from common import (
    REPO,
    command_line,
    cpu_line,
    join_group,
    now,
    publish,
    rank_results,
    result_path,
    save_rank_result,
    slowest_rank,
)
from zero_contenders import BUCKET, batch_for, build_fsdp2, zero_config

sys.path.insert(0, str(REPO))

from zengine import models  # noqa: E402
from zengine.models import GPT, ByteWindows  # noqa: E402

CONTENDERS = ["auto", "module", "leaf-blocks", "fsdp2"]


def build(name: str, model: torch.nn.Module):
    """(forward_backward, step, gathers issued so far) of contender ``name``."""
    if name == "fsdp2":
        trainer = build_fsdp2(model, BUCKET)
        return trainer.forward_backward, trainer.optimizer_step, lambda: -1
    import zengine

    config = zero_config(3, BUCKET)
    config["zero_optimization"]["stage3_gather_units"] = "auto" if name == "auto" else "module"
    if name == "leaf-blocks":
        zengine.utils.set_z3_leaf_modules(model, [type(model.blocks[0])])
    engine, *_ = zengine.initialize(model=model, config=config)
    check = engine.optimizer.fetcher.check

    def forward_backward(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    return forward_backward, engine.step, lambda: check.issued_count


def worker(rank, world, port, name, model_name, warmup, steps, out_dir) -> None:
    result = {"rank": rank}
    try:
        join_group(rank, world, port, minutes=5)
        torch.manual_seed(0)
        cfg = getattr(models, model_name)()
        forward_backward, step, issued = build(name, GPT(cfg))
        dataset = ByteWindows(cfg.seq_len)
        times, gathers, loss = [], [], None
        for i in range(warmup + steps):
            x, y = batch_for(dataset, i, rank, world)
            t0 = time.perf_counter()
            before = issued()
            loss = forward_backward(x, y)
            gathers.append(issued() - before)  # (the boundary step starts the count again)
            step()
            times.append(time.perf_counter() - t0)
        result.update(
            step_times=slowest_rank(times[warmup:]),
            gathers=gathers[1:],
            final_loss=loss.item(),
        )
        dist.barrier()
        dist.destroy_process_group()
    except Exception as error:  # reported in the table, not the end of the run
        result["error"] = repr(error)
    save_rank_result(out_dir, rank, result)


def summarize(runs: dict[str, list[dict]], args) -> str:
    lines = [
        f"# Stage-3 gather units at DeepSpeed's defaults ({now()})",
        "",
        f"{cpu_line()}; W={args.world}, model {args.model}, {args.rounds} round(s) of "
        f"{args.warmup} + {args.steps} steps; `{args.command}`",
        "",
        "| contender | all-gathers / step | vs leaf-blocks | step s (median) | vs leaf-blocks | loss |",
        "|---|---|---|---|---|---|",
    ]
    median = {
        n: statistics.median(t for r in rs for t in r["step_times"]) for n, rs in runs.items()
    }
    gathers = {n: statistics.mean(g for r in rs for g in r["gathers"]) for n, rs in runs.items()}
    base_t, base_g = median.get("leaf-blocks"), gathers.get("leaf-blocks")
    for name, rs in runs.items():
        g = gathers[name]
        g_text = "not counted" if g < 0 else f"{g:.1f}"
        g_ratio = f"{g / base_g:.2f}x" if g >= 0 and base_g else "n/a"
        t_ratio = f"{median[name] / base_t:.3f}x" if base_t else "n/a"
        lines.append(
            f"| {name} | {g_text} | {g_ratio} | {median[name]:.3f} | {t_ratio} | "
            f"{rs[-1]['final_loss']:.5f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default="bench20m")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default=None, help="folder for the report (default results/)")
    args = parser.parse_args(argv)
    args.command = command_line("bench_gather_units.py", argv)
    names = args.contenders.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else reversed(names):
            ranks = rank_results(
                worker, args.world, name, args.model, args.warmup, args.steps, label=name
            )
            failed = [r["error"] for r in ranks if "error" in r]
            if failed:
                raise RuntimeError(f"{name}: {failed[0]}")
            runs[name].append(ranks[0])
            print(f"round {rnd} {name}: gathers {ranks[0]['gathers']}", file=sys.stderr)
    publish(summarize(runs, args), result_path(args.out, "gather_units"))


if __name__ == "__main__":
    main()
