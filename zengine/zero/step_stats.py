"""What the ranks agree on at a boundary step, in one all-reduce and one host read.

Every boundary step sums one small float64 vector over the ranks, on the
compute device (NCCL takes only CUDA tensors): a header whose slots ``Slot``
names, then 1 per parameter this rank gave a gradient, else 0. A value every
rank must hold alike travels with its square (``_AGREED``): all ranks hold
the same value iff W * sum(v^2) == sum(v)^2. The header carries:

- the sum of squares of this rank's part of the unscaled gradient;
- whether this rank ran a backward since the last step, and whether its
  gradients are not reduced yet (its last backward ran under no_sync);
- this rank's micro-step count (the fingerprint of ranks in step);
- two digests of the gradient-bucket launch order this rank proposes (first
  step only, else 0);
- two 16-bit halves of the digest of the stage-3 gathers this rank issued
  since the last boundary (stage3/fetch_check.py ``FetchCheck``; 0 at other
  stages), and how many of its staged gathers came back with another rank's
  unit in a row.

The engine reads it back once (``sync.read_to_host``): the global norm,
overflow, whether the ranks are in step, and which parameters no rank used
all come from that single read. The failure paths (ranks out of step, a
parameter whose gradient went non-finite) run one more collective to name
the culprits; every rank reaches the same conclusion from the same sums, so
they take those paths together.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..distributed import collectives, sync
from ..distributed.diagnose import RanksOutOfStepError
from ..offload.copies import host_pinning


class Slot(enum.IntEnum):
    """The header's slots, in order; a slot followed by ``_SQ`` holds its value's square."""

    SQ_NORM = 0  # sum of squares of this rank's part of the unscaled gradient
    HAD_BACKWARD = enum.auto()
    MICRO_STEP = enum.auto()
    MICRO_STEP_SQ = enum.auto()
    UNREDUCED = enum.auto()
    ORDER_A = enum.auto()  # the bucket launch order's two digests (< 2^21)
    ORDER_A_SQ = enum.auto()
    ORDER_B = enum.auto()
    ORDER_B_SQ = enum.auto()
    FETCH_A = enum.auto()  # the stage-3 gathers' digest halves (< 2^16)
    FETCH_A_SQ = enum.auto()
    FETCH_B = enum.auto()
    FETCH_B_SQ = enum.auto()
    MIXED_GATHERS = enum.auto()  # staged gathers that came back with another rank's unit in a row


HEADER = len(Slot)  # the per-parameter used flags follow
# values every rank must hold alike, each beside its square (squares summed stay exact in float64)
_AGREED = (Slot.MICRO_STEP, Slot.ORDER_A, Slot.ORDER_B, Slot.FETCH_A, Slot.FETCH_B)


@dataclass
class RankValues:
    """What this rank brings to the step's all-reduce."""

    sq_norm: torch.Tensor  # 0-dim float64 wherever the gradients live (the host with offload)
    had_backward: bool
    micro_step: int
    used: list[bool]  # per parameter, in group order
    unreduced: bool = False
    order: tuple[int, int] = (0, 0)  # the bucket launch order's digests
    fetch_digest: tuple[int, int] = (0, 0)  # the stage-3 gathers' digest halves
    mixed_gathers: Optional[torch.Tensor] = None  # a device count, or None (no staged gathers)

    def header(self, norm_on_host: bool) -> list[float]:
        """The header's values (the norm only when it was summed on the host: else it is copied on
        the device, without a host read)."""
        head = [0.0] * HEADER
        head[Slot.SQ_NORM] = float(self.sq_norm) if norm_on_host else 0.0
        head[Slot.HAD_BACKWARD] = float(self.had_backward)
        head[Slot.UNREDUCED] = float(self.unreduced)
        agreed = (self.micro_step,) + tuple(self.order) + tuple(self.fetch_digest)
        for slot, value in zip(_AGREED, agreed):
            head[slot], head[slot + 1] = float(value), float(value) ** 2
        return head


@dataclass
class StepStats:
    """The summed vector, read on the host."""

    sq_norm: float
    ranks_with_backward: int
    ranks_unreduced: (
        int  # ranks whose gradients are still local (then sq_norm is not the global one)
    )
    used_counts: list[float]  # per parameter, in group order: how many ranks gave it a gradient
    orders_agree: bool = True  # every rank proposed the same bucket launch order (or none did)
    fetches_agree: bool = True  # every rank issued the same stage-3 gathers since the last boundary

    @property
    def norm(self) -> float:
        return math.sqrt(self.sq_norm) if self.sq_norm >= 0 else float("nan")


def gather_stats(
    mine: RankValues, device: torch.device, world: int, rank: int, comm_group=None
) -> StepStats:
    """Sum the step's control values over the ranks and read them once; raise when ranks are out of
    step."""
    # With offload the norm was summed on the host: it travels in the header (one upload, not two)
    norm_on_host = mine.sq_norm.device.type == "cpu"
    head = torch.tensor(
        mine.header(norm_on_host) + [float(u) for u in mine.used], dtype=torch.float64
    )
    if host_pinning(device):
        # from pinned memory, so that the upload is queued and the host goes on (a pageable one waits for
        # it); torch's pinned allocator reuses the block once the copy that reads it has run
        head = head.pin_memory()
    stats = head.to(device, non_blocking=True)  # [HEADER + params] float64 on the compute device
    if not norm_on_host:
        stats[Slot.SQ_NORM : Slot.SQ_NORM + 1].copy_(mine.sq_norm.reshape(1), non_blocking=True)
    if mine.mixed_gathers is not None:
        mixed = stats[Slot.MIXED_GATHERS : Slot.MIXED_GATHERS + 1]
        mixed.copy_(mine.mixed_gathers, non_blocking=True)
    if world > 1:
        collectives.all_reduce_sum(stats, comm_group)
    values = sync.read_to_host(stats)
    ranks_with_backward = int(round(values[Slot.HAD_BACKWARD]))
    ranks_unreduced = int(round(values[Slot.UNREDUCED]))
    if (
        not _agreed(values, Slot.MICRO_STEP, world)
        or 0 < ranks_with_backward < world
        or 0 < ranks_unreduced < world
    ):
        _raise_out_of_step(
            mine.micro_step, mine.had_backward, mine.unreduced, device, rank, comm_group
        )
    orders_agree = _agreed(values, Slot.ORDER_A, world) and _agreed(values, Slot.ORDER_B, world)
    fetches_agree = (
        values[Slot.MIXED_GATHERS] == 0
        and _agreed(values, Slot.FETCH_A, world)
        and _agreed(values, Slot.FETCH_B, world)
    )
    return StepStats(
        values[Slot.SQ_NORM],
        ranks_with_backward,
        ranks_unreduced,
        values[HEADER:],
        orders_agree,
        fetches_agree,
    )


def _agreed(values: list[float], slot: Slot, world: int) -> bool:
    """Every rank held the same value at ``slot`` (summed beside its square at ``slot + 1``)."""
    return _same_on_every_rank(values[slot], values[slot + 1], world)


def _same_on_every_rank(total: float, total_of_squares: float, world: int) -> bool:
    """From the sums over ranks of a value and of its square: every rank had the same value
    (W * sum(v^2) == sum(v)^2 holds only for equal values; exact while W * v^2 < 2^53)."""
    return world * total_of_squares == total**2


def _raise_out_of_step(
    micro_step: int,
    had_backward: bool,
    unreduced: bool,
    device: torch.device,
    rank: int,
    comm_group,
) -> None:
    mine = torch.tensor([micro_step, int(had_backward), int(unreduced)], dtype=torch.int64).to(
        device
    )
    everyone = collectives.all_gather_small(mine, comm_group).cpu().tolist()
    lines = "\n".join(
        f"  rank {r}: micro-step {m}{'' if b else ', no backward since the last step'}"
        f"{', its last backward under no_sync' if u else ''}"
        for r, (m, b, u) in enumerate(everyone)
    )
    raise RanksOutOfStepError(
        f"zengine: ranks reached the optimizer step out of step (rank {rank} noticed it first on this rank's "
        f"view):\n{lines}\nEvery rank must run the same number of forward/backward/step calls; a rank that "
        f"skipped or repeated a batch trains on mismatched data. Check data loaders of unequal length and "
        f"per-rank conditions around engine.backward()/engine.step()."
    )


def first_nonfinite(
    groups, master_grads: list[torch.Tensor], device: torch.device, world: int, comm_group=None
) -> str:
    """The name of the first parameter (in group order) whose gradient is not finite on any rank."""
    flags = []
    for g, grad in zip(groups, master_grads):
        bad = [0.0] * len(g.params)
        for pi, lo, hi in g.master_pieces():
            if hi > lo and not bool(torch.isfinite(grad[lo:hi]).all()):
                bad[pi] = 1.0
        flags.extend(bad)
    t = torch.tensor(flags, dtype=torch.float64).to(device)
    if world > 1:
        collectives.all_reduce_sum(t, comm_group)
    counts = t.cpu().tolist()
    names = [n for g in groups for n in g.param_names()]
    for name, c in zip(names, counts):
        if c > 0:
            return name
    return "<none found: the non-finite value came from the norm itself>"
