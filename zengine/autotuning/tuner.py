"""The search: a few short trials, in the order the memory and speed models predict best.

1. **Profile** (three trials; these may measure over the budget). The leanest family the config
   allows (the highest stage, offloaded where that saves device memory; of those within the host
   budget, once the first trial has measured the model) runs at the smallest micro batch and at one
   about four times larger: the model's size, the process's term and the per-sample slope are then
   measured (``memory.py``). Then a second family, the estimator's leanest of the others, at its
   largest micro batch likely to fit (else its smallest): the family most likely to fit is then
   predicted from its own reading, not from the estimator's error bound.
2. **Fast search.** Every candidate (``space.py``) whose peak bound (``memory.py``: the readings at
   the low end of their noise, a family not measured yet with the estimator's error at its worst)
   exceeds the per-rank budget less the margin, or whose host bytes exceed the host budget, is ruled
   out before it runs. Of the rest (of each family, the ``num_tuning_micro_batch_sizes`` largest
   micro batches), the one predicted fastest runs next; each result refits both models, which may
   rule candidates in or out. When none of those can win, what the bounds leave open is measured:
   a family not measured yet whose likely peaks fit and whose predicted speed beats the best runs
   its largest candidate within the bound; else, once per search (or while nothing has run within
   the budget), the near-budget probe: the candidate predicted fastest of those likely to fit and
   win (a measured family's first, within the speed model's noise), or while nothing has run within
   the budget the leanest candidate likely at most 10% over it; only this probe may measure over the
   budget. The search stops when the best measured result beats every remaining prediction even
   raised by the speed model's largest under-prediction of its last three trials (at least 3%, a
   short trial's noise) and nothing is left to measure; or after ``tuner_early_stopping`` trials in a
   row without a better result, or ``tuner_num_trials`` trials.
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
from .limits import Limits
from .memory import MemoryModel
from .model import SpeedModel
from .space import Candidate, Space, knob_choices
from .trials import Trial, TrialRunner, _mib

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
    # bytes per rank of host memory, for what offload puts there (a GPU machine; None: not budgeted)
    host_budget: Optional[int] = None
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    trials: list[Trial] = field(default_factory=list)
    probes: int = 0  # trials run near the budget (the prediction at the edge; may measure over it)
    memory: Optional[MemoryModel] = None
    limits: Optional[Limits] = None
    speed: Optional[SpeedModel] = None

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
                reason=self.limits.why_not(c),
            )
            for c in candidates
            if not self._tried(c) and not self.limits.fits(c)
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
        margin = self.settings.memory_margin
        self.limits = Limits(self.memory, self.budget, margin, self.host_budget)
        wire = 2 if _half_precision(self.user_config) else 4
        self.speed = SpeedModel(m["num_params"], self.world_size, wire, self.cpu)
        self._learn(trial)
        host_fits = [
            c for c in candidates if c.micro_batch == sizes[0] and self.limits.host_fits(c)
        ]
        if host_fits and not self.limits.host_fits(first):
            # the leanest on the device puts the most on the host, over its budget: the profile goes on
            # with the leanest family that fits the host
            lean = _leanest([c.family for c in host_fits])
            first = next(c for c in host_fits if c.family == lean)
            self._learn(self._run(first, "profile"))
        larger = [mb for mb in sizes if mb > sizes[0]]
        if larger:
            mb = min(larger, key=lambda b: abs(b - 4 * sizes[0]))
            second = next(c for c in candidates if c.family == lean and c.micro_batch == mb)
            self._learn(self._run(second, "profile"))
        third = self._second_family(candidates, lean)
        if third is not None:
            self._learn(self._run(third, "profile"))

    def _search(self, candidates: list[Candidate]) -> str:
        since_best = 0
        while True:
            if len(self.trials) >= self.settings.tuner_num_trials:
                return f"tuner_num_trials ({self.settings.tuner_num_trials}) reached"
            left = [c for c in self._eligible(candidates) if not self._tried(c)]
            nxt = max(left, key=self._predicted_score, default=None)
            stop = self._cannot_win(nxt, len(left))
            phase = "search"
            if nxt is None or stop:
                nxt, phase = self._to_measure(candidates)
                if nxt is None:
                    return stop or "every candidate that fits has run"
            trial = self._run(nxt, phase)
            improved = self._learn(trial)
            since_best = 0 if improved else since_best + 1
            if since_best >= self.settings.tuner_early_stopping:
                return f"tuner_early_stopping: {since_best} trials in a row without a better result"

    def _cannot_win(self, nxt: Optional[Candidate], left: int) -> str:
        """Why the search may stop at ``nxt`` (the best predicted of those that fit), or ""."""
        best = self._best()
        if nxt is None or best is None:
            return ""
        raise_by = self._raise_by()
        if self._predicted_score(nxt) * (1 + raise_by) >= best.score(self.settings.metric):
            return ""
        return (
            f"no remaining candidate is predicted to win (the best of {left} left, "
            f"{nxt.name}, raised by {raise_by:.0%}, stays below {best.candidate.name})"
        )

    def _to_measure(self, candidates: list[Candidate]) -> tuple[Optional[Candidate], str]:
        """When nothing predicted to fit can win: a trial that measures what the bounds leave open.
        First a family not measured yet that could win (its likely peaks fit and its predicted speed
        beats the best): its largest candidate predicted to fit. Else, once (or while nothing has run
        within the budget), the near-budget probe: the candidate predicted fastest of those likely
        (``central``) to fit and to win, whose bound alone rules it out; while nothing has run within
        the budget, else the leanest candidate likely within ``NEAR`` of it."""
        could_win = self._could_win(candidates)
        for family in dict.fromkeys(c.family for c in could_win):
            if self.memory.measured(family):
                continue
            safe = [c for c in candidates if c.family == family and not self._tried(c)]
            safe = [c for c in safe if self.limits.fits(c)]
            if safe:
                return max(safe, key=lambda c: c.micro_batch), "measures its family"
        if self.probes and self._best() is not None:
            return None, ""
        if (
            could_win
        ):  # of those within the speed model's noise of the fastest, a measured family's first:
            # its likely peak is the surer
            top = self._predicted_score(could_win[0]) / (1 + self._raise_by())
            surer = [
                c
                for c in could_win
                if self.memory.measured(c.family) and self._predicted_score(c) >= top
            ]
            could_win = surer + could_win
        probe = could_win[0] if could_win else self._near_the_budget(candidates)
        if probe is not None:
            self.probes += 1
        return probe, "near the budget"

    def _could_win(self, candidates: list[Candidate]) -> list[Candidate]:
        """Candidates not tried whose likely peak fits and whose predicted score (raised by the speed
        model's optimism) beats the best so far, fastest first."""
        best = self._best()
        bar = best.score(self.settings.metric) / (1 + self._raise_by()) if best else 0.0
        out = [
            c
            for c in candidates
            if not self._tried(c) and self.limits.likely_fits(c) and self._predicted_score(c) > bar
        ]
        return sorted(out, key=self._predicted_score, reverse=True)

    def _raise_by(self) -> float:
        return max(MIN_OPTIMISM, self._optimism())

    def _knobs(self, best: Trial) -> Trial:
        num_params = self.speed.num_params
        for key, values in knob_choices(best.candidate, self.user_config, num_params):
            for value in values:
                if len(self.trials) >= self.settings.tuner_num_trials:
                    return best
                candidate = best.candidate.with_knob(key, value)
                if self._tried(candidate) or not self.limits.fits(candidate):
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
        trial = Trial(candidate, phase=phase)
        if self.memory is not None:
            trial.predicted_peak = self.memory.bound(candidate)
            trial.predicted_seconds = self.speed.predict(candidate)
        cfg = candidate.config(self.user_config, self.world_size)
        reuse = not self.settings.overwrite
        self.runner.run(trial, cfg, reuse=reuse)
        if trial.ok and trial.metrics["peak_memory"] > self.budget:
            trial.status = "over budget"
            trial.reason = f"measured peak {_mib(trial.metrics['peak_memory'])} MiB > budget {_mib(self.budget)} MiB"
        host = _host_peak(trial.metrics, self.cpu)
        if (
            trial.ok
            and self.host_budget is not None
            and host is not None
            and host > self.host_budget
        ):
            trial.status = "over budget"
            trial.reason = (
                f"measured host peak {_mib(host)} MiB > host budget {_mib(self.host_budget)} MiB"
            )
        self.trials.append(trial)
        self.progress(trial.progress_line(len(self.trials), self._best() is trial))
        return trial

    def _learn(self, trial: Trial) -> bool:
        """Refit the models on ``trial``; True when it is the best so far."""
        if trial.metrics is None:
            if trial.status == "out of memory":
                self.memory.did_not_fit(trial.candidate)
            return False
        previous = self._best(excluding=trial)
        self.memory.observe(
            trial.candidate, trial.metrics["peak_memory"], _host_peak(trial.metrics, self.cpu)
        )
        if trial.ok or trial.status == "over budget":
            self.speed.observe(trial.candidate, trial.metrics["step_seconds"])
        return trial.ok and (
            previous is None
            or trial.score(self.settings.metric) > previous.score(self.settings.metric)
        )

    def _near_the_budget(self, candidates: list[Candidate]) -> Optional[Candidate]:
        """While nothing has run within the budget: the leanest candidate not tried whose likely peak
        (``central``) is within ``NEAR`` of the usable memory (at the edge of the budget, measuring
        beats ruling out the only configurations that might fit); never one over the host budget."""
        if self._best() is not None:
            return None
        near = [c for c in candidates if not self._tried(c) and self.limits.likely_fits(c, NEAR)]
        return min(near, key=self.memory.central, default=None)

    def _second_family(self, candidates: list[Candidate], lean) -> Optional[Candidate]:
        """The profile's trial of a second family: of the others, the one the estimator puts lowest, at
        its largest micro batch likely (``central``) to fit, else its smallest: its own remainder then
        replaces the estimator's error bound for the family most likely to fit."""
        others = [c for c in candidates if c.family != lean and not self._tried(c)]
        others = [c for c in others if self.limits.host_fits(c)]
        if not others:
            return None
        smallest = min(c.micro_batch for c in others)
        family = min(
            (c for c in others if c.micro_batch == smallest), key=self.memory.states
        ).family
        mine = sorted((c for c in others if c.family == family), key=lambda c: c.micro_batch)
        likely = [c for c in mine if self.limits.likely_fits(c)]
        return likely[-1] if likely else mine[0]

    def _eligible(self, candidates: list[Candidate]) -> list[Candidate]:
        """Those predicted to fit, and of each family only the ``num_tuning_micro_batch_sizes`` largest
        micro batches of those (DeepSpeed's count of micro-batch sizes tuned per stage)."""
        fits = [c for c in candidates if self.limits.fits(c)]
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


def _leanest(families: list[tuple[int, str, str]]) -> tuple[int, str, str]:
    """The family that keeps the least on the device: the highest stage, then CPU offload over none,
    NVMe last (it is the slowest to profile with)."""
    order = {"cpu": 2, "none": 1, "nvme": 0}
    return max(families, key=lambda f: (f[0], order[f[1]], order[f[2]]))


def _half_precision(cfg: dict) -> bool:
    return any((cfg.get(k) or {}).get("enabled") is True for k in ("bf16", "fp16", "bfloat16"))


def _host_peak(metrics: Optional[dict], cpu: bool) -> Optional[int]:
    """The ranks' largest host peak on a GPU machine (on a CPU the peak is the host's already)."""
    if cpu or not metrics or not metrics.get("host_peak_per_rank"):
        return None
    return int(max(metrics["host_peak_per_rank"]))
