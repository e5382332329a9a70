"""``zengine --autotuning tune|run [launcher options] script.py [args] --deepspeed_config cfg.json``.

``tune`` searches (``tuner.py``) and writes the results (``report.py``) under the config's
``autotuning.results_dir``; ``run`` does the same, then trains with the best config through the same
launcher options (with ``overwrite: false`` and a ``ds_config_optimal.json`` already there, it trains
with that one without tuning again). Trials run one at a time, each a launch of the script with the
same launcher options on a free port.

The per-rank memory budget is ``autotuning.memory_per_rank`` when set; else the device's memory on a
GPU machine, or on a CPU machine the memory available now divided by the ranks this machine runs. On
a GPU machine the host is budgeted too, for what offload puts there: ``autotuning.host_memory_per_rank``
when set, else the host memory available now divided by the ranks this machine runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import hjson
import psutil
import torch
from pydantic import ValidationError

from ..config.autotuning import AutotuningConfig
from .report import OPTIMAL_CONFIG, write_results
from .space import Space
from .trials import (
    ScriptArgsError,
    TrialRunner,
    config_argument,
    default_mappings,
    with_config,
)
from .tuner import Autotuner, TuningError


def launcher_argv(argv: Sequence[str], args: argparse.Namespace) -> list[str]:
    """The launcher's own options from ``argv``, less ``--autotuning MODE`` (the script and its
    arguments are the last ``1 + len(args.user_args)`` items)."""
    head = list(argv[: len(argv) - len(args.user_args) - 1])
    out, skip = [], False
    for arg in head:
        if skip:
            skip = False
        elif arg == "--autotuning":
            skip = True
        elif not arg.startswith("--autotuning="):
            out.append(arg)
    return out


def memory_budget(settings: AutotuningConfig, cpu: bool, ranks_here: int) -> int:
    """Bytes one rank may use at its peak (see the module doc)."""
    if settings.memory_per_rank:
        return int(settings.memory_per_rank)
    if (
        not cpu
    ):  # (the properties, not mem_get_info: no CUDA context in the launcher beside the ranks')
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(psutil.virtual_memory().available // max(1, ranks_here))


def host_budget(settings: AutotuningConfig, cpu: bool, ranks_here: int) -> Optional[int]:
    """Host bytes one rank may use at its peak on a GPU machine (see the module doc); None on a CPU
    machine, whose host the device budget is already."""
    if cpu:
        return None
    if settings.host_memory_per_rank:
        return int(settings.host_memory_per_rank)
    return int(psutil.virtual_memory().available // max(1, ranks_here))


def main(
    args: argparse.Namespace, argv: Sequence[str], world_size: int, ranks_here: int, cpu: bool
) -> int:
    """Tune (and with ``run``, train); returns the exit code."""
    from ..launcher.runner import main as launch  # (the launcher imports this module lazily)

    try:
        _, config_path = config_argument(args.user_args)
        with open(config_path) as f:
            user_config = dict(hjson.load(f))
        settings = AutotuningConfig.model_validate(user_config.get("autotuning") or {})
    except (ScriptArgsError, OSError, ValueError, ValidationError) as err:
        print(f"zengine --autotuning: {err}", file=sys.stderr)
        return 2
    own = launcher_argv(argv, args)
    results_dir = os.path.abspath(settings.results_dir)
    optimal = os.path.join(results_dir, OPTIMAL_CONFIG)
    if args.autotuning == "run" and not settings.overwrite and os.path.exists(optimal):
        print(f"[autotuning] overwrite is false: training with {optimal}", file=sys.stderr)
        return launch([*own, args.user_script, *with_config(args.user_args, optimal)])
    budget = memory_budget(settings, cpu, ranks_here)
    runner = TrialRunner(
        own,
        args.user_script,
        list(args.user_args),
        os.path.abspath(settings.exps_dir),
        settings.trial_timeout,
        default_mappings(args.user_args, settings.arg_mappings),
    )
    host = host_budget(settings, cpu, ranks_here)
    tuner = Autotuner(user_config, settings, runner, world_size, budget, cpu, host)
    try:
        space = Space.from_config(user_config, settings, cpu)
        print(
            f"[autotuning] {world_size} ranks, budget {budget / 2**20:,.0f} MiB per rank"
            + (f" (host {host / 2**20:,.0f} MiB)" if host is not None else "")
            + "; stages "
            f"{list(space.stages)}, optimizer offload {list(space.optimizer_offloads)}, parameter offload "
            f"{list(space.param_offloads)}, micro-batch sizes {[mb for mb, _ in space.batch_splits(world_size)]}",
            file=sys.stderr,
            flush=True,
        )
        outcome = tuner.tune()
    except (TuningError, ValueError) as err:
        print(f"zengine --autotuning: {err}", file=sys.stderr)
        return 1
    command = None
    if outcome.best is not None:
        command = ["zengine", *own, args.user_script, *with_config(args.user_args, optimal)]
    path = write_results(results_dir, outcome, user_config, command)
    print(f"[autotuning] {len(outcome.trials)} trials; stopped: {outcome.stopped}", file=sys.stderr)
    if path is None:
        print(
            f"[autotuning] no configuration ran within the budget; see {results_dir}/summary.md",
            file=sys.stderr,
        )
        return 1
    best = outcome.best.metrics
    print(
        f"[autotuning] best: {outcome.best.candidate.name} ({best['throughput']:.2f} samples/s, peak "
        f"{best['peak_memory'] / 2**20:,.0f} MiB); written to {path}\n[autotuning] run it with: "
        + " ".join(command),
        file=sys.stderr,
        flush=True,
    )
    if args.autotuning == "run":
        return launch([*own, args.user_script, *with_config(args.user_args, path)])
    return 0
