"""The autotuner against the whole grid tried by hand, on the main job's GPT (2 CPU ranks).

    python benchmarks/bench_autotuning.py [--model bench100m] [--max_mb 4] [--out DIR]

1. Every candidate of the space (stages 0-3 x micro batches) runs by hand, one trial each, with the
   tuner's profile steps; the per-rank budget is put half-way between stage 2's measured peak at the
   smallest micro batch and the smallest measured peak of stages 0-1: a budget that rules out stages 0
   and 1 (the tuner keeps 1% of it free, not its default 5%, as the budget sits that close to stage 2's
   peak). The grid's best that fits it (measured peak) is the reference.
2. ``zengine --autotuning tune`` then runs from scratch under that budget (timed, as a user runs it;
   it sees none of the grid's trials).

The report gives the tuner's time and trials against the grid's, its choice's samples/s and tokens/s
as a ratio of the grid's best within the budget, and each configuration's measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional

from common import REPO, command_line, cpu_line, now, publish, result_path

from zengine.autotuning.space import Candidate, Space
from zengine.autotuning.trials import Trial, TrialRunner
from zengine.autotuning.tuner import Autotuner
from zengine.config.autotuning import AutotuningConfig

SCRIPT = str(REPO / "examples" / "train_gpt.py")
WORLD = 2
MARGIN = 0.01  # the budget sits half-way between measured peaks: the default 5% would rule out stage 2 too


def user_config(folder: str, max_mb: int) -> dict:
    with open(REPO / "configs" / "autotuning" / "gpt.json") as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["reduce_bucket_size"] = 5_000_000  # configs/zero2.json's
    cfg["autotuning"].update(
        start_profile_step=2,
        end_profile_step=5,
        max_train_micro_batch_size_per_gpu=max_mb,
        results_dir=os.path.join(folder, "results"),
        exps_dir=os.path.join(folder, "exps"),
        overwrite=True,
    )
    return cfg


def budget_ruling_out_stages_0_1(grid: list[Trial]) -> int:
    """Half-way between stage 2's measured peak at the smallest micro batch and the smallest measured
    peak of stages 0-1 at any: no configuration of stages 0-1 fits it, stage 2 does."""
    smallest = min(t.candidate.micro_batch for t in grid)
    inside = max(
        t.metrics["peak_memory"]
        for t in grid
        if t.ok and t.candidate.stage == 2 and t.candidate.micro_batch == smallest
    )
    outside = min(t.metrics["peak_memory"] for t in grid if t.ok and t.candidate.stage < 2)
    if outside <= inside:
        raise SystemExit(
            f"stages 0-1 ({outside / 2**20:.0f} MiB) measured no more than stage 2 ({inside / 2**20:.0f})"
        )
    return int((inside + outside) / 2)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bench100m", choices=("tiny", "bench20m", "bench100m"))
    parser.add_argument("--max_mb", type=int, default=4)
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument(
        "--reuse_grid",
        default=None,
        help="a grid folder of an earlier run (its trials' metrics are read, not measured again)",
    )
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bench_autotuning_")
    cfg = user_config(folder, args.max_mb)
    path = os.path.join(folder, "ds_config.json")
    script_args = ["--model", args.model, "--deepspeed_config", path]
    with open(path, "w") as f:
        json.dump(cfg, f)
    settings = AutotuningConfig.model_validate(cfg["autotuning"])
    grid_dir = args.reuse_grid or os.path.join(folder, "grid")
    grid_runner = TrialRunner(["--num_procs", str(WORLD)], SCRIPT, script_args, grid_dir, 900)
    grid = []
    start = time.perf_counter()
    for c in Space.from_config(cfg, settings, True).candidates(WORLD):
        trial = grid_runner.run(Trial(c), c.config(cfg, WORLD), reuse=bool(args.reuse_grid))
        grid.append(trial)
        m = trial.metrics or {}
        print(
            f"grid {c.name}: {trial.status} {m.get('throughput', 0):.2f} samples/s peak "
            f"{m.get('peak_memory', 0) / 2**20:.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
    grid_seconds = time.perf_counter() - start
    budget = budget_ruling_out_stages_0_1(grid)
    usable = budget * (1 - MARGIN)
    cfg["autotuning"].update(memory_per_rank=budget, memory_margin=MARGIN)
    with open(path, "w") as f:
        json.dump(cfg, f)

    start = time.perf_counter()
    tune = subprocess.run(
        [
            sys.executable,
            "-m",
            "zengine.launcher.runner",
            "--autotuning",
            "tune",
            "--num_procs",
            str(WORLD),
            SCRIPT,
            *script_args,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    tune_seconds = time.perf_counter() - start
    print(tune.stderr[-4000:], file=sys.stderr)
    if tune.returncode != 0:
        return 1
    with open(os.path.join(folder, "results", "trials.json")) as f:
        tuned = json.load(f)
    fits = [t for t in grid if t.ok and t.metrics["peak_memory"] <= budget]
    grid_best = max(fits, key=lambda t: t.metrics["throughput"])
    chosen = next(t for t in grid if t.candidate.name == tuned["best"])
    chosen_trial = next(t for t in tuned["trials"] if t["name"] == tuned["best"])
    ratio = chosen.metrics["throughput"] / grid_best.metrics["throughput"]

    lines = [
        f"# Autotuning against the whole grid ({now()})",
        "",
        f"`{command_line('bench_autotuning.py', argv)}`; {cpu_line()}.",
        f"Main job's GPT `{args.model}` (`examples/train_gpt.py`), {WORLD} CPU ranks, `configs/autotuning/gpt.json` "
        f"(stage and micro batch open, reduce_bucket_size 5e6), profile steps 2-5. Budget "
        f"{budget / 2**20:,.0f} MiB per rank ({usable / 2**20:,.0f} usable after a 1% margin), put between "
        "stage 2 and stages 0-1 by the grid's measured peaks.",
        "",
        f"- **tune**: {len(tuned['trials'])} trials in {tune_seconds:.0f} s; stopped: {tuned['stopped']}; "
        f"chose **{tuned['best']}**, measured in its trial at peak {chosen_trial['measured_peak'] / 2**20:,.0f} MiB "
        f"(budget {budget / 2**20:,.0f}).",
        f"- **grid by hand**: {len(grid)} trials "
        + (
            f"read from {args.reuse_grid} (measured by an earlier run of this benchmark)"
            if args.reuse_grid
            else f"in {grid_seconds:.0f} s"
        )
        + "; best within the budget "
        f"**{grid_best.candidate.name}** ({grid_best.metrics['throughput']:.2f} samples/s).",
        f"- the tuner's choice in the grid's own run: {chosen.metrics['throughput']:.2f} samples/s = "
        f"**{ratio:.3f}x** the grid's best within the budget.",
        "",
        "| config | grid: samples/s | tokens/s | peak MiB | fits | tune: ran? | tune: outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    ran = {t["name"]: t for t in tuned["trials"]}
    ruled = {t["name"] for t in tuned["ruled_out"]}
    for t in grid:
        m = t.metrics or {}
        mine = ran.get(t.candidate.name)
        how = "yes" if mine else ("ruled out" if t.candidate.name in ruled else "not needed")
        lines.append(
            f"| {t.candidate.name} | {m.get('throughput', 0):.2f} | {m.get('tokens_per_second') or 0:,.0f} | "
            f"{m.get('peak_memory', 0) / 2**20:,.0f} | {'yes' if t.ok and m['peak_memory'] <= budget else 'no'} | "
            f"{how} | {mine['status'] if mine else '-'} |"
        )
    lines += [
        "",
        "The tuner's own report:",
        "",
        open(os.path.join(folder, "results", "summary.md")).read(),
    ]
    publish("\n".join(lines) + "\n", result_path(args.out, "autotuning"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
