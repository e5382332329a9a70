"""What a candidate may use per rank, judged on the memory model's predictions (``memory.py``).

The budget is the device's memory (on a CPU machine, the host's share per rank); on a GPU machine
the host is budgeted as well, for the states offload to CPU or NVMe puts there. Each is used less
the margin (``autotuning.memory_margin``: the measured peak's own run-to-run noise). A candidate
*fits* when its peak bound and its host bytes stay within them; it is *likely* to fit when its
central prediction does (what the tuner measures to learn, never what it rules in on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .memory import MemoryModel
from .space import Candidate
from .trials import _mib


@dataclass
class Limits:
    """The usable memory per rank and the tests of a candidate against it (see the module doc)."""

    memory: MemoryModel
    budget: int  # bytes per rank: the device's, or a CPU host's share
    margin: float
    host_budget: Optional[int] = (
        None  # bytes per rank of host memory on a GPU machine; None: not budgeted
    )

    @property
    def usable(self) -> float:
        return self.budget * (1.0 - self.margin)

    @property
    def host_usable(self) -> float:
        return float("inf") if self.host_budget is None else self.host_budget * (1.0 - self.margin)

    def fits(self, candidate: Candidate) -> bool:
        """The peak bound within the usable memory and the host bytes within the host's."""
        return self.memory.bound(candidate) <= self.usable and self.host_fits(candidate)

    def host_fits(self, candidate: Candidate) -> bool:
        return self.memory.host_bound(candidate) <= self.host_usable

    def likely_fits(self, candidate: Candidate, slack: float = 0.0) -> bool:
        """The central prediction within the usable memory raised by ``slack``; the host as ``fits``."""
        return self.memory.central(candidate) <= self.usable * (1 + slack) and self.host_fits(
            candidate
        )

    def why_not(self, candidate: Candidate) -> str:
        """Why ``candidate`` does not fit (for the report)."""
        bound = self.memory.bound(candidate)
        if bound == float("inf"):
            return "its family ran out of memory at this micro batch or a smaller one"
        if bound > self.usable:
            return (
                f"predicted peak {_mib(bound)} MiB > {_mib(self.usable)} MiB usable"
                + self.memory.unmeasured_note(candidate)
            )
        return (
            f"predicted host memory {_mib(self.memory.host_bound(candidate))} MiB per rank > "
            f"{_mib(self.host_usable)} MiB usable of the host's available memory"
        )
