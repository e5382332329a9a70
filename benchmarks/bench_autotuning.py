"""The autotuner against the whole grid tried by hand, on the main job's GPT (2 CPU ranks).

    python benchmarks/bench_autotuning.py [--model bench20m] [--max_mb 16] [--out DIR]

1. The profile (the tuner's first two trials) fits the memory model; the per-rank budget is then put
   half-way between the largest prediction of stage 2 at the two smallest micro batches and the
   smallest of stages 0-1 at micro batch 1: a budget that rules out stages 0 and 1 (stage 3 fits or
   not by its own prediction).
2. ``zengine --autotuning tune`` runs from scratch under that budget (timed, as a user runs it).
3. Every candidate of the same space (stages 0-3 x micro batches) runs by hand, one trial each, with
   the same profile steps: the grid's best that fits the budget (measured peak) is the reference.

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


def user_config(folder: str, max_mb: int) -> dict:
    with open(REPO / "configs" / "autotune.json") as f:
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


def budget_ruling_out_stages_0_1(cfg: dict, runner: TrialRunner) -> tuple[int, float]:
    """(budget, usable bytes) from the profile's memory model (the rule of the module doc)."""
    settings = AutotuningConfig.model_validate(cfg["autotuning"])
    tuner = Autotuner(cfg, settings, runner, WORLD, 1 << 40, cpu=True)
    space = Space.from_config(cfg, settings, True)
    tuner._profile(space, space.candidates(WORLD))
    sizes = sorted(mb for mb, _ in space.batch_splits(WORLD))[:2]
    inside = max(tuner.memory.bound(Candidate(2, "none", "none", mb, 1)) for mb in sizes)
    outside = min(tuner.memory.bound(Candidate(s, "none", "none", sizes[0], 1)) for s in (0, 1))
    if outside <= inside:
        raise SystemExit(
            f"stages 0-1 ({outside / 2**20:.0f} MiB) do not need more than 2-3 ({inside / 2**20:.0f})"
        )
    usable = (inside + outside) / 2
    return int(usable / (1 - settings.memory_margin)), usable


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bench20m", choices=("tiny", "bench20m"))
    parser.add_argument("--max_mb", type=int, default=16)
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bench_autotuning_")
    cfg = user_config(folder, args.max_mb)
    path = os.path.join(folder, "ds_config.json")
    script_args = ["--model", args.model, "--deepspeed_config", path]
    with open(path, "w") as f:
        json.dump(cfg, f)
    profile_runner = TrialRunner(
        ["--num_procs", str(WORLD)], SCRIPT, script_args, os.path.join(folder, "profile"), 900
    )
    budget, usable = budget_ruling_out_stages_0_1(cfg, profile_runner)
    cfg["autotuning"]["memory_per_rank"] = budget
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
    if tune.returncode != 0:
        print(tune.stderr[-3000:], file=sys.stderr)
        return 1
    tuned = json.load(open(os.path.join(folder, "results", "trials.json")))

    grid_runner = TrialRunner(
        ["--num_procs", str(WORLD)], SCRIPT, script_args, os.path.join(folder, "grid"), 900
    )
    settings = AutotuningConfig.model_validate(cfg["autotuning"])
    grid = []
    start = time.perf_counter()
    for c in Space.from_config(cfg, settings, True).candidates(WORLD):
        trial = grid_runner.run(Trial(c), c.config(cfg, WORLD))
        grid.append(trial)
        m = trial.metrics or {}
        print(
            f"grid {c.name}: {trial.status} {m.get('throughput', 0):.2f} samples/s peak "
            f"{m.get('peak_memory', 0) / 2**20:.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
    grid_seconds = time.perf_counter() - start
    fits = [t for t in grid if t.ok and t.metrics["peak_memory"] <= budget]
    grid_best = max(fits, key=lambda t: t.metrics["throughput"])
    chosen = next(t for t in grid if t.candidate.name == tuned["best"])
    chosen_trial = next(t for t in tuned["trials"] if t["name"] == tuned["best"])
    ratio = chosen.metrics["throughput"] / grid_best.metrics["throughput"]

    lines = [
        f"# Autotuning against the whole grid ({now()})",
        "",
        f"`{command_line('bench_autotuning.py', argv)}`; {cpu_line()}.",
        f"Main job's GPT `{args.model}` (`examples/train_gpt.py`), {WORLD} CPU ranks, `configs/autotune.json` "
        f"(stage and micro batch open, reduce_bucket_size 5e6), profile steps 2-5. Budget "
        f"{budget / 2**20:,.0f} MiB per rank ({usable / 2**20:,.0f} usable after the 5% margin), put between "
        "stages 2-3 and stages 0-1 by the profile's memory model.",
        "",
        f"- **tune**: {len(tuned['trials'])} trials in {tune_seconds:.0f} s; stopped: {tuned['stopped']}; "
        f"chose **{tuned['best']}**, measured in its trial at peak {chosen_trial['measured_peak'] / 2**20:,.0f} MiB "
        f"(budget {budget / 2**20:,.0f}).",
        f"- **grid by hand**: {len(grid)} trials in {grid_seconds:.0f} s; best within the budget "
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
