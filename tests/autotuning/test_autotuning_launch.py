"""``zengine --autotuning run`` on a user's script, 2 CPU ranks: a budget that rules out stage 0 (half-way
between the peaks of stages 0 and 2 at micro batch 1, measured apart from the tuner: 300 MB apart on this
model, where one configuration's peak varies by up to 100 MB from run to run),
a trial that fails mid-search, the results written, the best config re-read by ``initialize`` and
trained with; the pruning agrees with the peaks measured apart, no trial measured more than it was
predicted to (beyond that noise), and none after the profile over the budget but the near-budget
probe."""

import json
import os
import subprocess
import sys


from zengine.autotuning.space import Candidate
from zengine.autotuning.trials import Trial, TrialRunner
from zengine.config import load_config
from zengine.config.autotuning import AutotuningConfig

TARGET = os.path.join(os.path.dirname(__file__), "tune_target.py")


def user_config(tmp_path, **autotuning):
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 1000,
        "zero_optimization": {"stage": "auto", "reduce_bucket_size": 1_000_000},
        "autotuning": {
            "enabled": True,
            "start_profile_step": 2,
            "end_profile_step": 3,
            "max_train_micro_batch_size_per_gpu": 4,
            "num_tuning_micro_batch_sizes": 2,
            "results_dir": str(tmp_path / "results"),
            "exps_dir": str(tmp_path / "exps"),
            **autotuning,
        },
    }


def test_tune_then_run_within_a_budget_that_rules_out_stage_0(tmp_path):
    cfg = user_config(tmp_path)
    path = tmp_path / "ds_config.json"
    script_args = [
        "--deepspeed_config",
        str(path),
        "--fail_once_below_stage",  # the first trial after the profile (stage 3 twice, then the
        "3",  # estimator's leanest other family) below stage 3 fails
        "--fail_at",
        "2",
        "--marker",
        str(tmp_path / "runs-below-stage-3"),
    ]
    # 1. stages 0 and 2 at micro batch 1, measured apart from the tuner (it cannot reuse them): the
    # budget goes half-way between, so stage 0 does not fit and stage 2 does
    apart_args = ["--deepspeed_config", str(path)]
    measure = TrialRunner(["--num_procs", "2"], TARGET, apart_args, str(tmp_path / "apart"), 300)
    apart = {}
    for stage in (0, 2):
        c = Candidate(stage, "none", "none", 1, 1)
        trial = measure.run(Trial(c), c.config(cfg, 2))
        assert trial.ok, trial.reason
        apart[stage] = trial.metrics["peak_memory"]
    assert apart[0] - apart[2] > 200 << 20, apart  # wide enough to stand above the noise
    settings = AutotuningConfig.model_validate(cfg["autotuning"])
    usable = (apart[0] + apart[2]) / 2
    budget = int(usable / (1 - settings.memory_margin))
    cfg["autotuning"]["memory_per_rank"] = budget
    path.write_text(json.dumps(cfg))

    # 2. the whole search and the run, as a user starts it
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "zengine.launcher.runner",
            "--autotuning",
            "run",
            "--num_procs",
            "2",
            TARGET,
            *script_args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "results" / "trials.json").read_text())
    trials, ruled_out = results["trials"], results["ruled_out"]
    # stage 0 does not fit: never chosen; ruled out by its predicted peak, or, before a trial of it has
    # been measured (its prediction leans on the profile's stage 3), run once and found over the budget
    for t in trials:
        if t["delta"]["zero_optimization.stage"] == 0:
            assert t["status"] == "over budget" and t["measured_peak"] > budget, t
    assert any(t["name"].startswith("z0_") for t in ruled_out), ruled_out
    # after the profile (three trials) only the near-budget probe, once, may measure over the budget
    over = [t for t in trials[3:] if t["measured_peak"] and t["measured_peak"] > budget]
    assert len(over) <= 1 and all(t["phase"] == "near the budget" for t in over), over
    failed = [i for i, t in enumerate(trials) if t["status"] == "out of memory"]
    assert failed and "simulated: out of memory" in trials[failed[0]]["reason"]
    # the failure was recorded and skipped: the search ended by its own rules with a best that ran
    assert "did not run" not in run.stderr and results["best"] != trials[failed[0]]["name"]
    best = next(t for t in trials if t["name"] == results["best"])
    assert best["measured_peak"] <= budget
    seen = {"z3"}  # a family's trials after its first: predicted not below what they measured
    for t in trials[2:]:
        if t["measured_peak"] and t["name"][:2] in seen:
            assert t["measured_peak"] <= 1.15 * t["predicted_peak"], t
        seen.add(t["name"][:2])
    assert os.path.exists(tmp_path / "results" / "summary.md")
    svg = (tmp_path / "results" / "memory_vs_throughput.svg").read_text()
    assert svg.count("<circle") == sum(1 for t in trials if t["measured_peak"])

    # 3. the written config is a config; the run trained with it
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    loaded = load_config(optimal, world_size=2)
    delta = best["delta"]
    assert loaded.zero_optimization.stage == delta["zero_optimization.stage"]
    assert loaded.train_micro_batch_size_per_gpu == delta["train_micro_batch_size_per_gpu"]
    assert loaded.autotuning.metric_path is None  # not a trial: trains to the end
    trained = f"TRAINED stage={loaded.zero_optimization.stage} micro_batch={loaded.train_micro_batch_size_per_gpu} steps=4"
    assert trained in run.stdout, run.stdout[-2000:]
    command = (tmp_path / "results" / "cmd_optimal.txt").read_text()
    assert "ds_config_optimal.json" in command and "--fail_once_below_stage" in command

    # 4. the pruning against the peaks measured apart: stage 0 at micro batch 1, ruled out, needs more
    # than the budget allows; stage 2 at micro batch 1, which needs less, was not ruled out
    assert "z2_mb1_gas1" not in {t["name"] for t in ruled_out}
    assert apart[0] > usable > apart[2]
