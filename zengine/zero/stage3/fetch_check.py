"""The always-on check of stage 3's gathers: what each rank gathered, compared across ranks without
a collective of its own, and the failure path that names where the ranks parted.

Every gather is chained into a digest of what this rank gathered, and a gather of several parameters
carries a ``TAG``-element tag of its parameters' names in each rank's row, compared on the device
after the gather. The digest and the tag mismatches ride on the boundary step's all-reduce
(``step_stats.py``); when the ranks disagree, every rank raises ``FetchOrderError`` before the
optimizer updates anything, naming the first gather where they parted (a failure-path collective). A
forward outside training checks the tags at its end (one host read). Ranks that ran different
modules (data-dependent control flow, MoE routing) would otherwise gather different parameters in
the same collective: a hang on NCCL, or, when the sizes happen to agree, wrong values.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Optional

import torch

from ...distributed import collectives, diagnose, identity
from .param import ShardedParam

_LABEL_BYTES = 1024


class FetchOrderError(RuntimeError):
    """Ranks tried to gather different parameters at the same point: their programs diverged."""


# gathers remembered for naming a divergence (a step of a large model issues a few thousand)
_LOG = 65536
# elements of the in-band tag appended to each rank's row of a staged gather (bytes: exact in bf16)
TAG = 4
_LEAF_HINT = (
    diagnose.STAGE3_HINT + " Otherwise every rank must run the same modules in the same order."
)


def _tag_row(crc: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The crc's ``TAG`` little-endian bytes as a [TAG] row in ``dtype`` (bytes are exact in
    bf16/fp16), made on the device from a scalar: no upload from pageable host memory, which would
    make the host wait."""
    shifts = torch.arange(0, 8 * TAG, 8, dtype=torch.int64, device=device)
    return ((torch.full((TAG,), crc, dtype=torch.int64, device=device) >> shifts) & 0xFF).to(dtype)


class FetchCheck:
    """What this rank gathered since the last boundary step, to compare across ranks without a
    collective.

    ``digest``: crc32 chained over every gather's parameter names, in issue order; ``bad``: on the
    compute device, how many staged gathers came back with another rank's tag in a row (no host sync
    to update); ``log``: each gather's (unit crc, label parts), for naming the first divergence on
    the failure path."""

    def __init__(self, device: torch.device):
        self.device = device
        self.digest = 0
        # [1] float64 on the device, made at the first staged gather
        self.bad: Optional[torch.Tensor] = None
        self.log: deque = deque(maxlen=_LOG)  # (unit crc, label, params) of the latest gathers
        self.issued_count = 0
        self._units: dict[tuple[int, ...], tuple[int, torch.Tensor | None]] = {}

    def unit(
        self, params: list[ShardedParam], dtype: torch.dtype, device: torch.device, staged: bool
    ) -> tuple[int, Optional[torch.Tensor]]:
        """(crc of the unit's names, its expected tag row on ``device`` when ``staged``), made once
        per unit."""
        key = (*(id(sp) for sp in params), staged)
        known = self._units.get(key)
        if known is None or (known[1] is not None and known[1].dtype != dtype):
            crc = zlib.crc32("\0".join(sp.name for sp in params).encode())
            tag = _tag_row(crc, dtype, device) if staged else None
            known = self._units[key] = (crc, tag)
        return known

    def issued(self, crc: int, label: str, params: list[ShardedParam]) -> None:
        self.digest = zlib.crc32(crc.to_bytes(4, "little"), self.digest)
        self.log.append((crc, label, params))
        self.issued_count += 1

    def compare(self, rows: torch.Tensor, tag: torch.Tensor) -> None:
        """After a staged gather: count it when any rank's row carries another unit's tag (on the
        device)."""
        if self.bad is None:
            self.bad = torch.zeros(1, dtype=torch.float64, device=rows.device)
        self.bad += (rows != tag).any().to(torch.float64)

    def halves(self) -> tuple[int, int]:
        """The digest as two 16-bit values (their squares summed over ranks stay exact in float64)."""
        return self.digest >> 16, self.digest & 0xFFFF

    def reset(self) -> None:
        """A boundary step compared them: start over."""
        self.digest = 0
        self.log.clear()
        self.issued_count = 0
        if self.bad is not None:
            self.bad.zero_()
        unread = identity.pending(self.device)  # the identity checks' count on a device
        if unread is not None:
            unread.zero_()


# -- the failure path of the gather check: one exchange, then the error ----------------------------
def raise_fetches_diverged(check: FetchCheck, device: torch.device, comm_group, world: int) -> None:
    """Every rank calls this together once the sums show the ranks gathered differently: one
    failure-path exchange of the gathers each rank issued, then FetchOrderError naming where they
    parted."""
    crcs = [c for c, _, _ in check.log]
    first = check.issued_count - len(crcs)  # index of the oldest gather still in the log
    sizes = torch.tensor([check.issued_count, first], dtype=torch.int64).to(device)
    counts = collectives.all_gather_small(sizes, comm_group).view(-1, 2).cpu().tolist()
    longest = max(n for n, _ in counts)
    start = max(f for _, f in counts)
    mine = torch.full((max(longest - start, 1),), -1, dtype=torch.int64)
    window = crcs[start - first :]
    mine[: len(window)] = torch.tensor(window, dtype=torch.int64)
    rows = collectives.all_gather_small(mine.to(device), comm_group).view(world, -1).cpu()
    differ = (rows != rows[0]).any(dim=0).nonzero()
    at = int(differ[0]) if len(differ) else 0
    index = start + at
    entry = check.log[index - first] if first <= index < check.issued_count else None
    label = (
        f"{entry[1]} [{', '.join(sp.name for sp in entry[2])}]"
        if entry is not None
        else "(nothing: this rank had gathered less)"
    )
    labels = exchange_labels(label, device, comm_group, world)
    lines = "\n".join(
        f"  rank {r}: gather {index + 1} of {n}: {lab}"
        for r, (lab, (n, _)) in enumerate(zip(labels, counts))
    )
    check.reset()
    raise FetchOrderError(
        f"stage 3: the ranks gathered different parameters in the same "
        f"collective (caught before any update; each rank's gather where they "
        f"first parted):\n{lines}\n" + _LEAF_HINT
    )


def exchange_labels(label: str, device: torch.device, comm_group, world: int) -> list[str]:
    """Every rank's label, as fixed-size byte tensors (all_gather_object would need numpy)."""
    raw = label.encode()[:_LABEL_BYTES]
    mine = torch.zeros(_LABEL_BYTES, dtype=torch.uint8)
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    gathered = collectives.all_gather_small(mine.to(device), comm_group).view(world, -1).cpu()
    return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]


def gather_failed(
    params: list[ShardedParam], rank: int, count: int, error: RuntimeError
) -> BaseException:
    """A gather the backend refused (gloo: the ranks' sizes differ): name it on this rank. A failure
    the diagnosis already named (a timeout, a peer gone: each rank's position in its report) stays
    as it is."""
    if error is diagnose.first_reported() or isinstance(
        error, (diagnose.CollectiveTimeoutError, diagnose.RanksOutOfStepError)
    ):
        return error
    names = ", ".join(sp.name for sp in params)
    return FetchOrderError(
        f"stage 3: rank {rank}'s gather {count} of [{names}] failed "
        f"({type(error).__name__}: {error}); the likely cause is ranks "
        f"gathering different parameters at this point.\n" + _LEAF_HINT
    )
