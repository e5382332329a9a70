"""The search: a few short trials, in the order the memory and speed models predict best.

1. **Profile.** The leanest family the config allows (the highest stage, offloaded where that saves
   device memory) runs at the smallest micro batch and at one about four times larger: the model's size
   and both memory terms the estimator does not know (the process, activations per sample) are then
   measured (``model.py``).
2. **Fast search.** Every candidate (``space.py``) whose predicted peak exceeds the per-rank budget
   less the margin is ruled out before it runs. Of the rest (of each
   family, the ``num_tuning_micro_batch_sizes`` largest micro batches), the one predicted fastest runs next; each result refits both models, which may rule candidates in or out.
   While nothing has run within the budget, the leanest candidate predicted at most 10% over it runs
   too (a prediction is a few percent off, and at the edge of the budget it is all there is).
   The search stops when the best measured result beats every remaining prediction even raised by the
   speed model's largest under-prediction of its last three trials (at least 3%, a short trial's
   noise): nothing left can win; or after
   ``tuner_early_stopping`` trials in a row without a better result, or ``tuner_num_trials`` trials.
3. **Knobs** (``fast: false``): around the best, one key at a time (bucket sizes, gather units,
   ``sub_group_size``), keeping a value only when it is faster by more than the noise (2%).

A trial that fails (out of memory, a crash, a timeout, over the budget when measured) is recorded with
its reason and the search goes on; only a failing profile ends it, as then nothing can run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..config.autotuning import AutotuningConfig
from .model import MemoryModel, SpeedModel
from .space import Candidate, Space, knob_choices
from .trials import Trial, TrialRunner

NOISE = 0.02  # a knob's value is kept only when it beats the best by more than this
NEAR = (
    0.10  # while nothing fits, candidates predicted this far over the usable memory are still tried
)
MIN_OPTIMISM = (
    0.03  # remaining predictions are raised by at least this (the noise of a short trial)
)
RECENT = (
    3  # the speed model's error is judged on its last few predictions (it improves as trials come)
)


class TuningError(RuntimeError):
    """The search cannot go on (the profile failed, nothing fits); the message says why and what to do."""


@dataclass
class Outcome:
    """Every trial in the order run, the candidates ruled out without a run, the best, and why it stopped."""

    trials: list[Trial]
    ruled_out: list[Trial]
    best: Optional[Trial]
    stopped: str
    budget: int
    world_size: int
    metric: str


@dataclass
class Autotuner:
    """Finds the best config for the user's script within a per-rank memory budget (see the module doc)."""

    user_config: dict
    settings: AutotuningConfig
    runner: TrialRunner
    world_size: int
    budget: int
    cpu: bool
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    trials: list[Trial] = field(default_factory=list)
    memory: Optional[MemoryModel] = None
    speed: Optional[SpeedModel] = None

    @property
    def usable(self) -> float:
        return self.budget * (1.0 - self.settings.memory_margin)

    def tune(self) -> Outcome:
        space = Space.from_config(self.user_config, self.settings, self.cpu)
        candidates = space.candidates(self.world_size)
        self._profile(space, candidates)
        stopped = self._search(candidates)
        best = self._best()
        if best is not None and not self.settings.fast:
            best = self._knobs(best)
        ruled_out = [
            Trial(
                c,
                predicted_peak=self.memory.bound(c),
                status="ruled out",
                reason=_ruled_out_reason(self.memory.bound(c), self.usable),
            )
            for c in candidates
            if not self._tried(c) and self.memory.bound(c) > self.usable
        ]
        return Outcome(
            self.trials,
            ruled_out,
            best,
            stopped,
            self.budget,
            self.world_size,
            self.settings.metric,
        )

    # -- the steps -------------------------------------------------------------------------------
    def _profile(self, space: Space, candidates: list[Candidate]) -> None:
        lean = _leanest(space.families())
        sizes = sorted({c.micro_batch for c in candidates if c.family == lean})
        first = next(c for c in candidates if c.family == lean and c.micro_batch == sizes[0])
        trial = self._run(first, "profile")
        if trial.metrics is None:  # (over the budget, it still measured the model)
            raise TuningError(
                f"autotuning: the leanest configuration ({first.name}) did not run: {trial.status}, "
                f"{trial.reason}. See {trial.folder}/stdout.log; nothing leaner can be tried."
            )
        m = trial.metrics
        self.memory = MemoryModel(
            self.user_config,
            m["param_numels"],
            self.world_size,
            self.cpu,
            m.get("module_param_numels", []),
        )
        wire = 2 if _half_precision(self.user_config) else 4
        self.speed = SpeedModel(m["num_params"], self.world_size, wire, self.cpu)
        self._learn(trial)
        larger = [mb for mb in sizes if mb > sizes[0]]
        if larger:
            mb = min(larger, key=lambda b: abs(b - 4 * sizes[0]))
            second = next(c for c in candidates if c.family == lean and c.micro_batch == mb)
            self._learn(self._run(second, "profile"))

    def _search(self, candidates: list[Candidate]) -> str:
        since_best = 0
        while True:
            if len(self.trials) >= self.settings.tuner_num_trials:
                return f"tuner_num_trials ({self.settings.tuner_num_trials}) reached"
            left = [c for c in self._eligible(candidates) if not self._tried(c)]
            if not left:
                near = self._near_the_budget(candidates)
                if near is None:
                    return "every candidate that fits has run"
                self._learn(self._run(near, "near the budget"))
                continue
            nxt = max(left, key=self._predicted_score)
            best = self._best()
            if best is not None:
                raise_by = max(MIN_OPTIMISM, self._optimism())
                if self._predicted_score(nxt) * (1 + raise_by) < best.score(self.settings.metric):
                    return (
                        f"no remaining candidate is predicted to win (the best of {len(left)} left, "
                        f"{nxt.name}, raised by {raise_by:.0%}, stays below {best.candidate.name})"
                    )
            trial = self._run(nxt, "search")
            improved = self._learn(trial)
            since_best = 0 if improved else since_best + 1
            if since_best >= self.settings.tuner_early_stopping:
                return f"tuner_early_stopping: {since_best} trials in a row without a better result"

    def _knobs(self, best: Trial) -> Trial:
        num_params = self.speed.num_params
        for key, values in knob_choices(best.candidate, self.user_config, num_params):
            for value in values:
                if len(self.trials) >= self.settings.tuner_num_trials:
                    return best
                candidate = best.candidate.with_knob(key, value)
                if self._tried(candidate) or self.memory.bound(candidate) > self.usable:
                    continue
                trial = self._run(candidate, "knobs")
                self._learn(trial)
                if trial.ok and trial.score(self.settings.metric) > best.score(
                    self.settings.metric
                ) * (1 + NOISE):
                    best = trial
        return best

    # -- bookkeeping -------------------------------------------------------------------------------
    def _run(self, candidate: Candidate, phase: str) -> Trial:
        trial = Trial(candidate)
        if self.memory is not None:
            trial.predicted_peak = self.memory.bound(candidate)
            trial.predicted_seconds = self.speed.predict(candidate)
        cfg = candidate.config(self.user_config, self.world_size)
        reuse = not self.settings.overwrite
        self.runner.run(trial, cfg, reuse=reuse)
        if trial.ok and trial.metrics["peak_memory"] > self.budget:
            trial.status = "over budget"
            trial.reason = f"measured peak {_mib(trial.metrics['peak_memory'])} MiB > budget {_mib(self.budget)} MiB"
        self.trials.append(trial)
        self.progress(self._line(trial, phase))
        return trial

    def _learn(self, trial: Trial) -> bool:
        """Refit the models on ``trial``; True when it is the best so far."""
        if trial.metrics is None:
            if trial.status == "out of memory":
                self.memory.did_not_fit(trial.candidate)
            return False
        previous = self._best(excluding=trial)
        self.memory.observe(trial.candidate, trial.metrics["peak_memory"])
        if trial.ok or trial.status == "over budget":
            self.speed.observe(trial.candidate, trial.metrics["step_seconds"])
        return trial.ok and (
            previous is None
            or trial.score(self.settings.metric) > previous.score(self.settings.metric)
        )

    def _near_the_budget(self, candidates: list[Candidate]) -> Optional[Candidate]:
        """While nothing has run within the budget: the leanest candidate not tried whose predicted peak
        is within ``NEAR`` of the usable memory (a prediction is a few percent off; at the edge of the
        budget, measuring beats ruling out the only configurations that might fit)."""
        if self._best() is not None:
            return None
        near = [
            c
            for c in candidates
            if not self._tried(c) and self.memory.bound(c) <= self.usable * (1 + NEAR)
        ]
        return min(near, key=self.memory.bound, default=None)

    def _eligible(self, candidates: list[Candidate]) -> list[Candidate]:
        """Those predicted to fit, and of each family only the ``num_tuning_micro_batch_sizes`` largest
        micro batches of those (DeepSpeed's count of micro-batch sizes tuned per stage)."""
        fits = [c for c in candidates if self.memory.bound(c) <= self.usable]
        keep = self.settings.num_tuning_micro_batch_sizes
        out = []
        for family in dict.fromkeys(c.family for c in fits):
            mine = sorted((c for c in fits if c.family == family), key=lambda c: -c.micro_batch)
            out += mine[:keep]
        return out

    def _tried(self, candidate: Candidate) -> bool:
        return any(t.candidate == candidate for t in self.trials)

    def _best(self, excluding: Optional[Trial] = None) -> Optional[Trial]:
        ok = [t for t in self.trials if t.ok and t is not excluding]
        return max(ok, key=lambda t: t.score(self.settings.metric), default=None)

    def _predicted_score(self, candidate: Candidate) -> float:
        seconds = self.speed.predict(candidate)
        if self.settings.metric == "latency":
            return 1.0 / seconds
        return candidate.micro_batch * candidate.accumulation * self.world_size / seconds

    def _optimism(self) -> float:
        """How much faster than predicted (before it ran) a recent trial came out, at most."""
        ratios = [
            t.predicted_seconds / t.metrics["step_seconds"] - 1.0
            for t in self.trials
            if t.ok and t.predicted_seconds
        ]
        return max(ratios[-RECENT:], default=0.0)

    def _line(self, trial: Trial, phase: str) -> str:
        head = f"[autotuning] trial {len(self.trials)} ({phase}) {trial.candidate.name}: "
        if trial.metrics:
            m = trial.metrics
            tokens = (
                f", {m['tokens_per_second']:,.0f} tokens/s" if m.get("tokens_per_second") else ""
            )
            pred = f" (predicted {_mib(trial.predicted_peak)})" if trial.predicted_peak else ""
            text = (
                f"{m['throughput']:.2f} samples/s{tokens}, {m['step_seconds'] * 1e3:.0f} ms/step, "
                f"peak {_mib(m['peak_memory'])} MiB{pred}"
            )
            if not trial.ok:
                text += f" - {trial.status}"
        else:
            text = f"{trial.status}: {trial.reason}"
        best = self._best()
        mark = " - best so far" if best is trial else ""
        return head + text + f" [{trial.wall_seconds:.0f} s]" + mark


def _leanest(families: list[tuple[int, str, str]]) -> tuple[int, str, str]:
    """The family that keeps the least on the device: the highest stage, then CPU offload over none,
    NVMe last (it is the slowest to profile with)."""
    order = {"cpu": 2, "none": 1, "nvme": 0}
    return max(families, key=lambda f: (f[0], order[f[1]], order[f[2]]))


def _half_precision(cfg: dict) -> bool:
    return any((cfg.get(k) or {}).get("enabled") is True for k in ("bf16", "fp16", "bfloat16"))


def _ruled_out_reason(bound: float, usable: float) -> str:
    if bound == float("inf"):
        return "its family ran out of memory at this micro batch or a smaller one"
    return f"predicted peak {_mib(bound)} MiB > {_mib(usable)} MiB usable"


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"
