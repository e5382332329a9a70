"""The tuner's step-time model (its memory model is ``memory.py``).

A step is the sum of costs that scale with what the candidate moves (``features``): a fixed
cost per micro-step, compute per sample, bytes collected between ranks (ZeRO's volumes per stage:
stage 3 gathers the parameters twice per micro-step, stage 2 reduces gradients every micro-step),
optimizer elements stepped on this rank, bytes copied to and from offloaded memory, bytes through NVMe.
The costs start at priors for the machine (CPU or GPU) and are refitted after every trial by a least
squares on relative errors, pulled toward the priors where the trials say little (ridge).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
