"""What the tuner leaves in ``results_dir``: the best config, the command to run it, a table and a plot.

- ``ds_config_optimal.json``: the user's config with the best trial's choices (``autotuning`` as the
  user wrote it), which ``zengine.initialize`` reads as any config;
- ``cmd_optimal.txt``: the launch command with that config in place of the user's;
- ``summary.md``: every trial (why it ran, config delta, predicted peak bound and measured peak, step
  time, samples/s, tokens/s, how it ended), the candidates ruled out before running and why the search stopped;
- ``trials.json``: the same, for programs;
- ``memory_vs_throughput.svg``: each trial's measured peak against its throughput, the budget as a line.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Optional, Sequence

from .trials import Trial
from .tuner import Outcome, _mib

OPTIMAL_CONFIG = "ds_config_optimal.json"
OPTIMAL_COMMAND = "cmd_optimal.txt"


def optimal_config(user_config: dict, best: Trial, world_size: int) -> dict:
    """The user's config with the best trial's choices written in, its autotuning section untouched."""
    cfg = best.candidate.config(user_config, world_size)
    if "autotuning" in user_config:
        cfg["autotuning"] = user_config["autotuning"]
    return cfg


def write_results(
    results_dir: str,
    outcome: Outcome,
    user_config: dict,
    command: Optional[Sequence[str]],
) -> Optional[str]:
    """Write every file of the module doc; returns the optimal config's path (None: nothing ran well)."""
    os.makedirs(results_dir, exist_ok=True)
    path = None
    if outcome.best is not None:
        path = os.path.join(results_dir, OPTIMAL_CONFIG)
        with open(path, "w") as f:
            json.dump(optimal_config(user_config, outcome.best, outcome.world_size), f, indent=2)
        if command is not None:
            with open(os.path.join(results_dir, OPTIMAL_COMMAND), "w") as f:
                f.write(shlex.join(command) + "\n")
    with open(os.path.join(results_dir, "trials.json"), "w") as f:
        json.dump(
            {
                "budget_per_rank": outcome.budget,
                "world_size": outcome.world_size,
                "metric": outcome.metric,
                "stopped": outcome.stopped,
                "best": outcome.best.candidate.name if outcome.best else None,
                "trials": [
                    t.row() | {"delta": t.candidate.delta(outcome.world_size)}
                    for t in outcome.trials
                ],
                "ruled_out": [t.row() for t in outcome.ruled_out],
            },
            f,
            indent=2,
        )
    with open(os.path.join(results_dir, "summary.md"), "w") as f:
        f.write(summary(outcome))
    with open(os.path.join(results_dir, "memory_vs_throughput.svg"), "w") as f:
        f.write(plot(outcome))
    return path


def summary(outcome: Outcome) -> str:
    """A markdown table of every trial, then the candidates ruled out and why the search stopped."""
    lines = [
        "# Autotuning results",
        "",
        f"Budget {_mib(outcome.budget)} MiB per rank, {outcome.world_size} ranks, metric {outcome.metric}. "
        f"Best: **{outcome.best.candidate.name if outcome.best else 'none'}**. Stopped: {outcome.stopped}.",
        "",
        "| # | trial | ran as | config delta | predicted peak MiB | measured peak MiB | step ms | samples/s "
        "| tokens/s | wall s | outcome |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, t in enumerate(outcome.trials, 1):
        r = t.row()
        delta = ", ".join(
            f"{k.rsplit('.', 1)[-1]}={v}" for k, v in t.candidate.delta(outcome.world_size).items()
        )
        best = " (best)" if t is outcome.best else ""
        lines.append(
            f"| {i} | {t.candidate.name}{best} | {t.phase} | {delta} | {_mib(r['predicted_peak'])} | {_mib(r['measured_peak'])} "
            f"| {_num(r['step_seconds'], 1e3)} | {_num(r['samples_per_second'])} | {_num(r['tokens_per_second'])} "
            f"| {t.wall_seconds:.0f} | {t.status}{': ' + t.reason if t.reason else ''} |"
        )
    if outcome.ruled_out:
        lines += ["", f"Ruled out before running ({len(outcome.ruled_out)}):", ""]
        lines += [f"- {t.candidate.name}: {t.reason}" for t in outcome.ruled_out]
    return "\n".join(lines) + "\n"


def _num(value, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:,.1f}"


def plot(outcome: Outcome, width: int = 640, height: int = 400) -> str:
    """An SVG scatter of measured peak memory (x) against throughput (y), the budget as a dashed line."""
    points = [
        (t.metrics["peak_memory"] / 2**20, t.metrics["throughput"], t)
        for t in outcome.trials
        if t.metrics
    ]
    pad = 60
    xmax = max([p[0] for p in points] + [outcome.budget / 2**20]) * 1.1 or 1.0
    ymax = max([p[1] for p in points], default=1.0) * 1.15 or 1.0

    def x(v: float) -> float:
        return pad + v / xmax * (width - 2 * pad)

    def y(v: float) -> float:
        return height - pad - v / ymax * (height - 2 * pad)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">peak memory per rank (MiB)</text>',
        f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" text-anchor="middle">'
        "samples / s</text>",
    ]
    for i in range(5):
        xv, yv = xmax * i / 4, ymax * i / 4
        out.append(
            f'<text x="{x(xv):.0f}" y="{height - pad + 15}" text-anchor="middle">{xv:,.0f}</text>'
        )
        out.append(f'<text x="{pad - 5}" y="{y(yv) + 4:.0f}" text-anchor="end">{yv:,.1f}</text>')
    bx = x(outcome.budget / 2**20)
    out.append(
        f'<line x1="{bx:.1f}" y1="{pad}" x2="{bx:.1f}" y2="{height - pad}" stroke="red" stroke-dasharray="5,4"/>'
    )
    out.append(f'<text x="{bx + 4:.1f}" y="{pad + 10}" fill="red">budget</text>')
    for mem, rate, t in points:
        colour = "green" if t is outcome.best else ("steelblue" if t.ok else "gray")
        out.append(f'<circle cx="{x(mem):.1f}" cy="{y(rate):.1f}" r="5" fill="{colour}"/>')
        out.append(f'<text x="{x(mem) + 7:.1f}" y="{y(rate) - 6:.1f}">{t.candidate.name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
