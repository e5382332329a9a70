"""The tuner's memory predictions: an upper bound on a candidate's peak bytes per rank, refined by trials.

A peak is the estimator's model states and step transients (``zengine/estimate.py``) plus a
remainder it does not count: the process itself, the script's data, the activations of the micro
batch, and the estimator's own error, which differs by family (stage and offload; on the tuning
test model stage 3's remainder was 150-300 MB of 1.3 GB below the others'). Each trial measures one
remainder (``peak - states``); a measured peak varies from run to run (the engine's init transients:
up to ~100 MB of 1.5 GB here), by at most ``noise`` of its clean value, so a reading says the clean
remainder lies within about ``rest +- noise x peak``. The bound on a candidate is the smallest of what the
readings allow:

- **a family that has run**: from each of its readings, the remainder at its highest moved to the
  candidate's micro batch by the per-sample slope's upper bound (its lower bound, at least 0, going
  down: memory grows with the micro batch);
- **a family that has not**: from each reading of another family, the same, plus ``error`` of the
  measured family's estimate (its remainder, cleared of that family's error at its worst) and
  ``error`` of the candidate's own estimate (this family's error at its worst);
- **the per-sample slope**: from each pair of readings of one family at two micro batches, the rise
  over the span, widened by both readings' noise: the smallest upper bound and the largest lower
  bound over the pairs. A profile's short span under noisy peaks gives a wide band (the slope is
  then known only as far as the noise allows), which the larger micro batches measured later narrow.
  With no pair yet, the whole remainder of a reading counts as activations (an upper bound while
  the process term is positive).

``central`` is the likely peak (the least-squares slope; a family not measured gets the smallest
measured family's remainder): the tuner uses it to choose what to measure, never to rule in. A
trial that ran out of memory rules out its family at its micro batch and above.

**Host memory** (a GPU machine, offload to CPU or NVMe): the estimator's host bytes of the candidate
plus the largest host remainder measured (the process's own host memory), against the host budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..config import load_config
from ..estimate import MemoryEstimate, estimate
from .space import Candidate

ESTIMATE_ERROR = (
    0.25  # of a family's estimate: its error at most, until one of its trials measures it
)
PEAK_NOISE = (
    0.05  # of a measured peak: its run-to-run variation at most (the engine's init transients)
)

Family = tuple[int, str, str]


def memory_estimate(
    candidate: Candidate,
    base: dict,
    numels: Sequence[int],
    world: int,
    cpu: bool,
    modules: Sequence[Sequence[int]] = (),
) -> MemoryEstimate:
    """The estimator's figures for ``candidate``; ``modules``: the sizes of the parameters of each
    module that owns several (the probe's ``module_param_numels``)."""
    cfg = load_config(_estimator_config(candidate.config(base, world)), world)
    threshold = cfg.zero_optimization.stage3_param_persistence_threshold
    multi = any(sum(1 for n in m if n >= threshold) > 1 for m in modules)
    return estimate(list(numels), cfg, world, cpu_training=cpu, multi_parameter_modules=multi)


def _estimator_config(cfg: dict) -> dict:
    """The keys the estimator reads, less what a script fills in at run time ("auto" optimizer values)."""
    keep = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    out = {k: cfg[k] for k in keep if k in cfg}
    for k in ("zero_optimization", "bf16", "fp16", "communication_data_type", "data_types"):
        if k in cfg:
            out[k] = cfg[k]
    for section in ("bf16", "fp16"):
        if isinstance(out.get(section), dict) and out[section].get("enabled") == "auto":
            out[section] = {**out[section], "enabled": False}
    return out


def model_state_bytes(est: MemoryEstimate, cpu: bool) -> int:
    """What the estimate puts in the budget's memory: on a CPU the device and the host are one."""
    return est.peak_device + (est.host_states if cpu else 0)


@dataclass(frozen=True)
class Reading:
    """One measured trial: its family and micro batch, its peak and the part the estimator missed."""

    family: Family
    micro_batch: int
    peak: float
    states: float  # the estimator's figure for the trial's candidate
    rest: float  # peak - states

    def upper(self, noise: float) -> float:
        """The clean remainder at its highest (the reading at the low end of its noise: a clean peak
        of ``peak / (1 - noise)``)."""
        return self.rest + self.peak * noise / (1.0 - noise)

    def lower(self, noise: float) -> float:
        """The clean remainder at its lowest (the reading at the high end of its noise)."""
        return self.rest - self.peak * noise / (1.0 + noise)


@dataclass
class MemoryModel:
    """Peak bytes per rank of a candidate, on the device and on the host (see the module doc)."""

    base_config: dict
    numels: Sequence[int]
    world: int
    cpu: bool
    modules: Sequence[Sequence[int]] = ()  # the probe's module_param_numels
    noise: float = PEAK_NOISE
    error: float = ESTIMATE_ERROR
    readings: list[Reading] = field(default_factory=list)
    ceilings: dict = field(default_factory=dict)  # family -> smallest micro batch out of memory
    host_rest: Optional[float] = None  # the largest measured host peak less the host estimate
    _estimates: dict = field(default_factory=dict, repr=False)

    def estimate(self, candidate: Candidate) -> MemoryEstimate:
        if candidate not in self._estimates:
            self._estimates[candidate] = memory_estimate(
                candidate, self.base_config, self.numels, self.world, self.cpu, self.modules
            )
        return self._estimates[candidate]

    def states(self, candidate: Candidate) -> int:
        return model_state_bytes(self.estimate(candidate), self.cpu)

    def measured(self, family: Family) -> bool:
        return any(r.family == family for r in self.readings)

    # -- the slope -----------------------------------------------------------------------------
    def slope(self) -> tuple[float, float, float]:
        """(lower bound, least-squares fit, upper bound) of the bytes per sample of micro batch."""
        low, high = 0.0, float("inf")
        for a, b in self._pairs():
            span, noise = b.micro_batch - a.micro_batch, self.noise
            low = max(low, (b.lower(noise) - a.upper(noise)) / span)
            high = min(high, (b.upper(noise) - a.lower(noise)) / span)
        if high == float("inf"):  # no pair: the whole remainder, at most, is activations
            high = min((r.upper(self.noise) / r.micro_batch for r in self.readings), default=0.0)
        high = max(low, high)
        return low, min(max(self._fit(), low), high), high

    def _pairs(self):
        for i, a in enumerate(self.readings):
            for b in self.readings[i + 1 :]:
                if a.family == b.family and a.micro_batch != b.micro_batch:
                    yield (a, b) if a.micro_batch < b.micro_batch else (b, a)

    def _fit(self) -> float:
        """Least squares of the remainder on the micro batch within each family (pooled)."""
        num = den = 0.0
        for family in {r.family for r in self.readings}:
            mine = [r for r in self.readings if r.family == family]
            mean_mb = sum(r.micro_batch for r in mine) / len(mine)
            mean_rest = sum(r.rest for r in mine) / len(mine)
            num += sum((r.micro_batch - mean_mb) * (r.rest - mean_rest) for r in mine)
            den += sum((r.micro_batch - mean_mb) ** 2 for r in mine)
        return max(0.0, num / den) if den else 0.0

    # -- the predictions -------------------------------------------------------------------------
    def bound(self, candidate: Candidate) -> float:
        """The candidate's peak at its highest (see the module doc); infinite at or above a micro
        batch of the family that ran out of memory, or before anything was measured."""
        if candidate.micro_batch >= self.ceilings.get(candidate.family, float("inf")):
            return float("inf")
        low, _, high = self.slope()
        own = self.measured(candidate.family)
        states = self.states(candidate)
        best = float("inf")
        for r in self.readings:
            if own and r.family != candidate.family:
                continue
            moved = candidate.micro_batch - r.micro_batch
            rest = r.upper(self.noise) + (high if moved > 0 else low) * moved
            if not own:  # the measured family's error at its worst out, this family's in
                rest += self.error * (r.states + states)
            best = min(best, states + rest)
        return best

    def central(self, candidate: Candidate) -> float:
        """The likely peak: the fitted slope, the family's mean remainder (a family not measured: the
        smallest measured family's); infinite as ``bound`` is."""
        if not self.readings or candidate.micro_batch >= self.ceilings.get(
            candidate.family, float("inf")
        ):
            return float("inf")
        _, fit, _ = self.slope()
        terms: dict[Family, list[float]] = {}
        for r in self.readings:
            terms.setdefault(r.family, []).append(r.rest - fit * r.micro_batch)
        means = {f: sum(v) / len(v) for f, v in terms.items()}
        term = means.get(candidate.family, min(means.values()))
        return self.states(candidate) + term + fit * candidate.micro_batch

    def unmeasured_note(self, candidate: Candidate) -> str:
        """Why a bound is wide: for a family not measured, the estimator's error at its worst."""
        if self.measured(candidate.family):
            return ""
        return (
            f" (its family not measured yet: the estimate's error up to {self.error:.0%} counted)"
        )

    def host_bound(self, candidate: Candidate) -> float:
        """Host bytes per rank: the estimator's host states plus the largest host remainder measured
        (0 on a CPU machine, whose host is the device the budget is for)."""
        if self.cpu:
            return 0.0
        return self.estimate(candidate).host_states + max(0.0, self.host_rest or 0.0)

    # -- what trials say ---------------------------------------------------------------------------
    def observe(self, candidate: Candidate, peak: int, host_peak: Optional[int] = None) -> None:
        """A measured trial (``host_peak``: the ranks' largest host peak, on a GPU machine)."""
        states = self.states(candidate)
        self.readings.append(
            Reading(candidate.family, candidate.micro_batch, float(peak), states, peak - states)
        )
        if host_peak is not None and not self.cpu:
            rest = host_peak - self.estimate(candidate).host_states
            self.host_rest = rest if self.host_rest is None else max(self.host_rest, rest)

    def did_not_fit(self, candidate: Candidate) -> None:
        """``candidate`` ran out of memory: from now on its family is ruled out at this micro batch and
        above (memory grows with the micro batch), whatever the readings say."""
        family, mb = candidate.family, candidate.micro_batch
        self.ceilings[family] = min(self.ceilings.get(family, mb), mb)
