"""The tuner's predictions: a candidate's peak memory per rank and its step time, refined by each trial.

**Memory.** The model states and step transients come from the estimator (``zengine/estimate.py``, the
ZeRO formulas checked against measured peaks); what it does not count (the process itself, the
script's data, activations) is fitted from the trials as ``base + per_sample x micro_batch``: the
tuner's first two trials (the profile) run the leanest family at two micro-batch sizes, which gives
``per_sample``; ``base`` is each family's own once one of its trials has run (the estimator is more
exact for some families than others), before that the smallest of those run; a trial that ran out of
memory rules out its family at its micro batch and above. A candidate is tried only if this prediction stays within the
budget less the margin; a trial measured over the budget is recorded and never chosen.

**Time.** A step is the sum of costs that scale with what the candidate moves (``features``): a fixed
cost per micro-step, compute per sample, bytes collected between ranks (ZeRO's volumes per stage:
stage 3 gathers the parameters twice per micro-step, stage 2 reduces gradients every micro-step),
optimizer elements stepped on this rank, bytes copied to and from offloaded memory, bytes through NVMe.
The costs start at priors for the machine (CPU or GPU) and are refitted after every trial by a least
squares on relative errors, pulled toward the priors where the trials say little (ridge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..config import load_config
from ..estimate import estimate
from .space import Candidate

FEATURES = (
    "micro-step",
    "sample",
    "collective byte",
    "optimizer element",
    "offload byte",
    "NVMe byte",
)

# Priors, seconds per unit of each feature: a starting point only, the trials replace them.
PRIORS = {
    "cpu": (2e-3, 1e-3, 1 / 1.5e9, 1 / 4e8, 1 / 5e9, 1 / 1e9),
    "cuda": (1e-3, 1e-4, 1 / 5e10, 1 / 2e10, 1 / 1.2e10, 1 / 3e9),
}


def memory_estimate(
    candidate: Candidate,
    base: dict,
    numels: Sequence[int],
    world: int,
    cpu: bool,
    modules: Sequence[Sequence[int]] = (),
):
    """The estimator's figures for ``candidate`` (a ``MemoryEstimate``); ``modules``: the sizes of the
    parameters of each module that owns several (the probe's ``module_param_numels``)."""
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


def model_state_bytes(est, cpu: bool) -> int:
    """What the estimate puts in the budget's memory: on a CPU the device and the host are one."""
    return est.peak_device + (est.host_states if cpu else 0)


@dataclass
class MemoryModel:
    """Peak bytes per rank of a candidate (see the module doc)."""

    base_config: dict
    numels: Sequence[int]
    world: int
    cpu: bool
    per_sample: float = 0.0
    modules: Sequence[Sequence[int]] = ()  # the probe's module_param_numels
    bases: dict = field(default_factory=dict)  # family -> fitted bytes beyond the estimate
    ceilings: dict = field(default_factory=dict)  # family -> smallest micro batch out of memory
    observed: list = field(default_factory=list)  # (family, micro batch, measured - estimated)

    def states(self, candidate: Candidate) -> int:
        est = memory_estimate(
            candidate, self.base_config, self.numels, self.world, self.cpu, self.modules
        )
        return model_state_bytes(est, self.cpu)

    def base(self, candidate: Candidate) -> float:
        """The family's own fitted term; for a family not measured yet, the smallest of those measured:
        the estimator's errors differ by family (by 150-300 MB of 1.3 GB on a test model, stage 3
        worse), so a family is given the benefit of the doubt until one of its trials measures it."""
        if candidate.family in self.bases:
            return self.bases[candidate.family]
        return min(self.bases.values(), default=0.0)

    def bound(self, candidate: Candidate) -> float:
        """The predicted peak: the estimate, the family's term, the activations of the micro batch;
        infinite at or above a micro batch of the family that ran out of memory."""
        if candidate.micro_batch >= self.ceilings.get(candidate.family, float("inf")):
            return float("inf")
        return (
            self.states(candidate) + self.base(candidate) + self.per_sample * candidate.micro_batch
        )

    def observe(self, candidate: Candidate, peak: int) -> None:
        """A measured trial: refit. The per-sample slope comes from micro batches of one family (the
        profile's), each family's term is the largest of its trials' remainders, so every trial run is
        predicted at or above what it measured."""
        self.observed.append(
            (candidate.family, candidate.micro_batch, peak - self.states(candidate))
        )
        num = den = 0.0
        for family in {f for f, _, _ in self.observed}:
            mine = [(mb, rest) for f, mb, rest in self.observed if f == family]
            mean_mb = sum(mb for mb, _ in mine) / len(mine)
            mean_rest = sum(rest for _, rest in mine) / len(mine)
            num += sum((mb - mean_mb) * (rest - mean_rest) for mb, rest in mine)
            den += sum((mb - mean_mb) ** 2 for mb, _ in mine)
        self.per_sample = max(0.0, num / den) if den else 0.0
        self.bases = {}
        for family, mb, rest in self.observed:
            term = rest - self.per_sample * mb
            self.bases[family] = max(self.bases.get(family, term), term)

    def did_not_fit(self, candidate: Candidate) -> None:
        """``candidate`` ran out of memory: from now on its family is ruled out at this micro batch and
        above (memory grows with the micro batch), whatever the fit says."""
        family, mb = candidate.family, candidate.micro_batch
        self.ceilings[family] = min(self.ceilings.get(family, mb), mb)


def features(
    candidate: Candidate, num_params: int, world: int, wire_bytes: int, cpu: bool
) -> list[float]:
    """What one optimizer step of ``candidate`` does, in the units of ``FEATURES``."""
    p, w = float(num_params), float(world)
    share = (w - 1) / w if w > 1 else 0.0  # of a ring collective's bytes, each rank's part
    mb, gas = candidate.micro_batch, candidate.accumulation
    stage = candidate.stage
    if stage == 0:
        moved = 2 * share * p * wire_bytes  # one all-reduce of the gradients at the boundary
    elif stage == 1:
        moved = (
            2 * share * p * wire_bytes
        )  # reduce-scatter at the boundary, all-gather of the update
    elif stage == 2:
        moved = (
            gas * share * p * wire_bytes + share * p * wire_bytes
        )  # reduce-scatter per micro-step
    else:  # gathered for the forward and again for the backward, reduce-scattered, every micro-step
        moved = gas * 3 * share * p * wire_bytes
    stepped = p / w if stage >= 1 else p
    offload = nvme = 0.0
    if candidate.offload_optimizer == "cpu" and not cpu:
        offload = gas * stepped * wire_bytes + stepped * wire_bytes  # gradients down, parameters up
    if candidate.offload_optimizer == "nvme":
        nvme = stepped * 16 * 2  # moments (and, stage 3, masters) read and written back
    if candidate.offload_param == "cpu" and not cpu:
        offload += gas * 2 * p / w * wire_bytes
    if candidate.offload_param == "nvme":
        nvme += gas * 2 * p / w * wire_bytes
    return [float(gas), float(gas * mb), moved, stepped, offload, nvme]


@dataclass
class SpeedModel:
    """Seconds per optimizer step of a candidate (see the module doc)."""

    num_params: int
    world: int
    wire_bytes: int
    cpu: bool
    prior: list = field(default_factory=list)
    costs: list = field(default_factory=list)
    observed: list = field(default_factory=list)  # (features, measured seconds)
    ridge: float = 0.3

    def __post_init__(self):
        self.prior = list(PRIORS["cpu" if self.cpu else "cuda"])
        self.costs = list(self.prior)

    def features(self, candidate: Candidate) -> list[float]:
        return features(candidate, self.num_params, self.world, self.wire_bytes, self.cpu)

    def predict(self, candidate: Candidate) -> float:
        return sum(f * c for f, c in zip(self.features(candidate), self.costs))

    def observe(self, candidate: Candidate, seconds: float) -> None:
        phi = self.features(candidate)
        if not self.observed:
            # the first trial sets the compute prior: what the other priors do not explain
            other = sum(f * c for i, (f, c) in enumerate(zip(phi, self.prior)) if i != 1)
            self.prior[1] = max(0.1 * seconds, seconds - other) / phi[1]
        self.observed.append((phi, seconds))
        self._refit()

    def _refit(self) -> None:
        # costs = prior * (1 + u); minimise sum ((phi.costs - t) / t)^2 + ridge * |u|^2
        n = len(FEATURES)
        rows, rhs = [], []
        for phi, t in self.observed:
            rows.append([phi[j] * self.prior[j] / t for j in range(n)])
            rhs.append(1.0 - sum(phi[j] * self.prior[j] for j in range(n)) / t)
        a = torch.tensor(rows, dtype=torch.float64)
        b = torch.tensor(rhs, dtype=torch.float64)
        lhs = a.T @ a + self.ridge * torch.eye(n, dtype=torch.float64)
        u = torch.linalg.solve(lhs, a.T @ b).tolist()
        self.costs = [self.prior[j] * max(0.02, 1.0 + u[j]) for j in range(n)]
