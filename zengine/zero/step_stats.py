"""What the ranks agree on at a boundary step, in one all-reduce and one host read.

Every boundary step sums one small float64 vector over the ranks, on the
compute device (NCCL takes only CUDA tensors):

    [0]   sum of squares of this rank's part of the unscaled gradient
    [1]   1 if this rank ran a backward since the last step, else 0
    [2]   this rank's micro-step count       (the fingerprint:
    [3]   its square                          all ranks equal iff W * [3] == [2]^2)
    [4]   1 if this rank's gradients are not reduced yet (its last backward ran under no_sync)
    [5:9] two digests of the gradient-bucket launch order this rank proposes, and their squares
          (first step only, else 0: every rank proposes the same order iff W * squares == sums^2)
    [9:13] two 16-bit halves of the digest of the stage-3 gathers this rank issued since the last
          boundary, and their squares (stage3/fetcher.py ``FetchCheck``; 0 at other stages)
    [13]  how many of this rank's staged stage-3 gathers came back with another rank's unit in a row
    [14:] 1 per parameter this rank gave a gradient, else 0

The engine reads it back once (``sync.read_to_host``): the global norm,
overflow, whether the ranks are in step, and which parameters no rank used
all come from that single read. The failure paths (ranks out of step, a
parameter whose gradient went non-finite) run one more collective to name
the culprits; every rank reaches the same conclusion from the same sums, so
they take those paths together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..distributed import collectives, sync
from ..distributed.diagnose import RanksOutOfStepError
from ..offload.copies import host_pinning

_HEADER = 14


@dataclass
class StepStats:
    """The summed vector, read on the host."""

    sq_norm: float
    ranks_with_backward: int
    ranks_unreduced: int      # ranks whose gradients are still local (then sq_norm is not the global one)
    used_counts: list[float]  # per parameter, in group order: how many ranks gave it a gradient
    orders_agree: bool = True  # every rank proposed the same bucket launch order (or none did)
    fetches_agree: bool = True  # every rank issued the same stage-3 gathers since the last boundary

    @property
    def norm(self) -> float:
        return math.sqrt(self.sq_norm) if self.sq_norm >= 0 else float("nan")


def gather_stats(sq_norm: torch.Tensor, had_backward: bool, micro_step: int, used: list[bool],
                 device: torch.device, world: int, rank: int, comm_group=None, unreduced: bool = False,
                 order: tuple[int, int] = (0, 0), fetches: tuple = (0, 0, None)) -> StepStats:
    """Sum the step's control values over the ranks and read them once; raise when ranks are out of step.

    ``sq_norm`` is a 0-dim float64 tensor wherever the gradients live (the host with offload); ``fetches``
    the stage-3 gather check (digest halves, device count of mixed gathers or None).
    """
    d1, d2 = float(order[0]), float(order[1])  # < 2^21: squares summed over ranks stay exact in float64
    f1, f2, bad = float(fetches[0]), float(fetches[1]), fetches[2]  # < 2^16
    # With offload the norm was summed on the host: it travels in the header (one upload, not two)
    norm_on_host = sq_norm.device.type == "cpu"
    head = torch.tensor([float(sq_norm) if norm_on_host else 0.0, float(had_backward), float(micro_step),
                         float(micro_step) ** 2, float(unreduced), d1, d1 * d1, d2, d2 * d2, f1, f1 * f1, f2, f2 * f2,
                         0.0] + [float(u) for u in used], dtype=torch.float64)
    if host_pinning(device):
        # from pinned memory, so that the upload is queued and the host goes on (a pageable one waits for
        # it); torch's pinned allocator reuses the block once the copy that reads it has run
        head = head.pin_memory()
    stats = head.to(device, non_blocking=True)  # [_HEADER + params] float64 on the compute device
    if not norm_on_host:
        stats[0:1].copy_(sq_norm.reshape(1), non_blocking=True)
    if bad is not None:
        stats[13:14].copy_(bad, non_blocking=True)
    if world > 1:
        collectives.all_reduce_sum(stats, comm_group)
    values = sync.read_to_host(stats)
    ranks_with_backward, ranks_unreduced = int(round(values[1])), int(round(values[4]))
    if (not _same_on_every_rank(values[2], values[3], world) or 0 < ranks_with_backward < world
            or 0 < ranks_unreduced < world):
        _raise_out_of_step(micro_step, had_backward, unreduced, device, rank, comm_group)
    agree = _same_on_every_rank(values[5], values[6], world) and _same_on_every_rank(values[7], values[8], world)
    fetches_agree = (values[13] == 0 and _same_on_every_rank(values[9], values[10], world)
                     and _same_on_every_rank(values[11], values[12], world))
    return StepStats(values[0], ranks_with_backward, ranks_unreduced, values[_HEADER:], agree, fetches_agree)


def _same_on_every_rank(total: float, total_of_squares: float, world: int) -> bool:
    """From the sums over ranks of a value and of its square: every rank had the same value
    (W * sum(v^2) == sum(v)^2 holds only for equal values; exact while W * v^2 < 2^53)."""
    return world * total_of_squares == total ** 2


def _raise_out_of_step(micro_step: int, had_backward: bool, unreduced: bool, device: torch.device, rank: int,
                       comm_group) -> None:
    mine = torch.tensor([micro_step, int(had_backward), int(unreduced)], dtype=torch.int64).to(device)
    everyone = collectives.all_gather_small(mine, comm_group).cpu().tolist()
    lines = "\n".join(f"  rank {r}: micro-step {m}{'' if b else ', no backward since the last step'}"
                      f"{', its last backward under no_sync' if u else ''}"
                      for r, (m, b, u) in enumerate(everyone))
    raise RanksOutOfStepError(
        f"zengine: ranks reached the optimizer step out of step (rank {rank} noticed it first on this rank's "
        f"view):\n{lines}\nEvery rank must run the same number of forward/backward/step calls; a rank that "
        f"skipped or repeated a batch trains on mismatched data. Check data loaders of unequal length and "
        f"per-rank conditions around engine.backward()/engine.step().")


def first_nonfinite(groups, master_grads: list[torch.Tensor], device: torch.device, world: int,
                    comm_group=None) -> str:
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
