"""The autotuner's search without processes: a stand-in runner answers each trial from a known machine
(step time and peak memory as functions of the candidate), so the order, the pruning and the stop rules
are checked against the whole grid's truth."""

import pytest

from zengine.autotuning.model import MemoryModel, features
from zengine.autotuning.space import Candidate, Space
from zengine.autotuning.trials import (
    HF_MAPPINGS,
    Trial,
    config_argument,
    default_mappings,
    with_config,
    with_mapped_args,
)
from zengine.autotuning.tuner import Autotuner, TuningError
from zengine.config.autotuning import AutotuningConfig
from zengine.config import load_config

NUMELS = [1_000_000] * 20  # 20M parameters
WORLD = 2
BASE = 300 << 20  # the process itself
PER_SAMPLE = 6 << 20  # activations
TRUE_COSTS = (4e-3, 6e-3, 1 / 1e9, 1 / 3e8, 0.0, 0.0)  # seconds per unit of model.FEATURES


def user_config(**autotuning) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"reduce_bucket_size": 1_000_000},
        "autotuning": {"max_train_micro_batch_size_per_gpu": 32, **autotuning},
    }


class Machine:
    """What a trial would measure: the estimator's states plus the process and activations, and a
    step time from the true costs; ``crash`` names candidates that fail."""

    def __init__(self, cfg, crash=(), extra=None):
        self.memory = MemoryModel(cfg, NUMELS, WORLD, cpu=True)
        self.crash = set(crash)
        self.extra = extra or {}  # stage -> bytes the estimator does not know of (its error)
        self.runs: list[Candidate] = []

    def peak(self, c: Candidate) -> int:
        extra = self.extra.get(c.stage, 0)
        return int(self.memory.states(c) + BASE + extra + PER_SAMPLE * c.micro_batch)

    def seconds(self, c: Candidate) -> float:
        phi = features(c, sum(NUMELS), WORLD, 4, cpu=True)
        return sum(f * k for f, k in zip(phi, TRUE_COSTS))

    def run(self, trial: Trial, cfg: dict, reuse: bool = False) -> Trial:
        c = trial.candidate
        self.runs.append(c)
        if c.name in self.crash:
            trial.status, trial.reason = "crashed", "exit 1: RuntimeError: boom"
            return trial
        s = self.seconds(c)
        batch = c.micro_batch * c.accumulation * WORLD
        trial.metrics = {
            "peak_memory": self.peak(c),
            "step_seconds": s,
            "latency": s,
            "throughput": batch / s,
            "num_params": sum(NUMELS),
            "param_numels": NUMELS,
            "tokens_per_second": None,
        }
        trial.status = "ok"
        return trial


def tuner_for(cfg, machine, budget):
    settings = AutotuningConfig.model_validate(cfg["autotuning"])
    return Autotuner(cfg, settings, machine, WORLD, budget, cpu=True, progress=lambda line: None)


def grid_best(machine, cfg, budget, settings):
    space = Space.from_config(cfg, settings, True)
    fits = [c for c in space.candidates(WORLD) if machine.peak(c) <= budget]
    return max(fits, key=lambda c: c.micro_batch * c.accumulation * WORLD / machine.seconds(c))


@pytest.mark.parametrize("budget_mib", [640, 800, 2000])
def test_search_finds_the_grid_best_within_the_budget_in_fewer_trials(budget_mib):
    cfg = user_config()
    machine = Machine(cfg)
    budget = budget_mib << 20
    tuner = tuner_for(cfg, machine, budget)
    outcome = tuner.tune()
    grid = Space.from_config(cfg, tuner.settings, True).candidates(WORLD)
    best = grid_best(machine, cfg, budget * (1 - tuner.settings.memory_margin), tuner.settings)
    assert outcome.best.candidate == best, [t.candidate.name for t in outcome.trials]
    assert len(outcome.trials) < len(grid) / 2  # 28 candidates
    # nothing over the budget ran after the profile, and every candidate ruled out would not have fit
    assert all(machine.peak(t.candidate) <= budget for t in outcome.trials[2:])
    assert all(machine.peak(t.candidate) > budget * 0.9 for t in outcome.ruled_out)
    assert "predicted" in outcome.stopped or "every candidate" in outcome.stopped


def test_budget_rules_out_stages_0_and_1():
    cfg = user_config()
    machine = Machine(cfg)
    stage2 = machine.peak(Candidate(2, "none", "none", 1, 1))
    stage1 = machine.peak(Candidate(1, "none", "none", 1, 1))
    assert stage1 - stage2 > 30 << 20
    budget = (stage1 + stage2) // 2 / 0.95
    outcome = tuner_for(cfg, machine, int(budget)).tune()
    assert {t.candidate.stage for t in outcome.trials} <= {2, 3}
    assert {t.candidate.stage for t in outcome.ruled_out} >= {0, 1}


def test_a_trial_that_fails_is_recorded_and_the_search_goes_on():
    cfg = user_config()
    clean = tuner_for(cfg, Machine(cfg), 2000 << 20).tune()
    crash = clean.trials[2].candidate.name  # the first trial after the profile
    machine = Machine(cfg, crash=[crash])
    outcome = tuner_for(cfg, machine, 2000 << 20).tune()
    failed = [t for t in outcome.trials if t.candidate.name == crash]
    assert failed[0].status == "crashed" and "boom" in failed[0].reason
    assert outcome.trials.index(failed[0]) < len(outcome.trials) - 1  # trials after it
    assert outcome.best is not None and outcome.best.candidate.name != crash


def test_a_failing_profile_ends_the_search_with_the_reason():
    cfg = user_config(max_train_micro_batch_size_per_gpu=4)
    machine = Machine(cfg, crash=["z3_mb1_gas1"])
    with pytest.raises(TuningError, match=r"\(z3_mb1_gas1\) did not run: crashed"):
        tuner_for(cfg, machine, 2000 << 20).tune()


def test_early_stopping_and_trial_cap():
    cfg = user_config(tuner_num_trials=4)
    outcome = tuner_for(cfg, Machine(cfg), 2000 << 20).tune()
    assert len(outcome.trials) == 4 and "tuner_num_trials" in outcome.stopped


def test_fixed_keys_are_kept_and_open_ones_tuned():
    settings = AutotuningConfig(max_train_micro_batch_size_per_gpu=16)
    space = Space.from_config(
        {
            "train_batch_size": 32,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "auto"}},
        },
        settings,
        cpu_training=False,
    )
    assert space.families() == [(2, "none", "none"), (2, "cpu", "none")]
    assert space.batch_splits(2) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
    cpu_space = Space.from_config(
        {"zero_optimization": {"offload_optimizer": {"device": "auto"}}}, settings, True
    )
    assert all(opt == "none" for _, opt, _ in cpu_space.families())  # the host is the device
    cfg = Candidate(3, "cpu", "cpu", 4, 2).config({"optimizer": {"type": "Adam"}}, 2)
    loaded = load_config(cfg, world_size=2)
    assert (
        loaded.zero_optimization.stage == 3
        and loaded.zero_optimization.offload_param.device == "cpu"
    )
    assert loaded.train_batch_size == 16 and loaded.gradient_accumulation_steps == 2


def test_script_arguments():
    assert config_argument(["--x", "1", "--deepspeed_config", "a.json"]) == (3, "a.json")
    assert with_config(["--deepspeed=a.json", "--y"], "b.json") == ["--deepspeed=b.json", "--y"]
    assert with_config(["--deepspeed", "--deepspeed_config", "a.json"], "b.json")[-1] == "b.json"
    mapped = with_mapped_args(
        ["--per_device_train_batch_size", "1"],
        {
            "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gas",
        },
        {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2},
    )
    assert mapped == ["--per_device_train_batch_size", "8", "--gas", "2"]
    with pytest.raises(ValueError, match="name no config file"):
        config_argument(["--deepspeed"])


def test_section_validation():
    with pytest.raises(Exception, match="flops"):
        load_config(
            {"train_micro_batch_size_per_gpu": 1, "autotuning": {"metric": "flops"}}, world_size=1
        )
    with pytest.raises(Exception, match="end_profile_step"):
        load_config(
            {
                "train_micro_batch_size_per_gpu": 1,
                "autotuning": {"start_profile_step": 5, "end_profile_step": 5},
            },
            world_size=1,
        )


def test_slow_mode_tries_the_knobs_around_the_best():
    cfg = user_config(fast=False)
    outcome = tuner_for(cfg, Machine(cfg), 2000 << 20).tune()
    knob_trials = [t for t in outcome.trials if t.candidate.knobs]
    best_family = outcome.best.candidate.family
    assert knob_trials and all(t.candidate.family == best_family for t in knob_trials)
    keys = {k for t in knob_trials for k, _ in t.candidate.knobs}
    assert "zero_optimization.reduce_bucket_size" not in keys  # the user's config sets it
    assert "zero_optimization.overlap_comm" in keys
    # the machine's time does not depend on them: nothing within the noise is kept
    assert outcome.best.candidate.knobs == ()


def test_hugging_face_scripts_get_their_batch_arguments_mapped():
    hf = ["--deepspeed", "ds.json", "--per_device_train_batch_size=4"]
    assert default_mappings(hf, None) == HF_MAPPINGS
    assert default_mappings(hf, {}) == {}  # the user's own say, even empty
    assert default_mappings(["--deepspeed_config", "ds.json"], None) is None
    args = with_mapped_args(
        hf, HF_MAPPINGS, {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1}
    )
    assert args == [
        "--deepspeed",
        "ds.json",
        "--per_device_train_batch_size=16",
        "--gradient_accumulation_steps",
        "1",
    ]


def test_the_shipped_tuning_config_leaves_stage_and_micro_batch_open():
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "autotuning" / "gpt.json"
    user = json.loads(path.read_text())
    settings = AutotuningConfig.model_validate(user["autotuning"])
    space = Space.from_config(user, settings, cpu_training=True)
    assert space.stages == (0, 1, 2, 3) and space.micro_batches is None
    loaded = load_config(Candidate(2, "none", "none", 8, 1).config(user, 2), world_size=2)
    assert loaded.zero_optimization.stage == 2 and loaded.train_batch_size == 16


def test_at_the_edge_of_the_budget_the_leanest_near_candidate_is_measured():
    # the estimator understates stages 0, 1 and 3 by 60 MB against stage 2, and the profile runs stage 3:
    # stage 2 is predicted 60 MB over a budget it fits. Measured as the leanest candidate near the budget,
    # it fits; the family's prediction is corrected and its larger micro batches follow
    cfg = user_config(max_train_micro_batch_size_per_gpu=4)
    machine = Machine(cfg, extra={3: 60 << 20, 0: 60 << 20, 1: 60 << 20})
    budget = int((machine.peak(Candidate(2, "none", "none", 4, 1)) + (2 << 20)) / 0.95)
    lines = []
    tuner = tuner_for(cfg, machine, budget)
    tuner.progress = lines.append
    outcome = tuner.tune()
    assert "(near the budget) z2_mb1_gas1" in lines[2], lines
    assert outcome.best.candidate == Candidate(2, "none", "none", 4, 1), lines
    assert {t.candidate.stage for t in outcome.trials[2:]} == {2}
