"""The identity check every collective carries, whatever the transport: ranks that make different
collectives at the same point are named, on every rank, before any byte of either moves.

A collective's identity is its kind, dtype and sizes (``identity``), a 31-bit number every rank that
makes the same collective computes alike. Before the payload moves, the ranks all-reduce
``[identity, -identity]`` with MAX: the result equals its own negation's (``max == min``) only when
every rank brought the same identity. The check is one collective of two int64 on the payload's
device, the same on every path:

- shared memory (``shm.py``): the sync that marks each piece written IS this all-reduce, so the
  check costs no extra collective;
- gloo: one extra all-reduce before the payload, read at once (a CPU tensor: no device to wait
  for). Without it a payload of other sizes aborts the process inside gloo (SIGABRT,
  ``op.preamble.length <= op.nbytes``), where nothing can be named;
- other backends (NCCL): the same all-reduce, queued on the device before the payload and never
  read on the host mid-step (the step's one host read stays the only one, tests/test_device_guard):
  the comparison is counted on the device (``pending``) and read with the boundary step's values or
  when a collective fails.

Because every collective of a group is preceded by its check (or is a shared-memory sync), a check
always pairs with a check: the first collective where the ranks' programs part is caught at its
check, whatever came before. A mismatch is a failure path every rank takes together: one exchange
of where each rank was (``diagnose.current``), then ``CollectiveMismatchError`` naming every rank's
collective, or ``RanksOutOfStepError`` when the ranks ran different numbers of forwards (each
rank's own end-of-sequence in a generation loop at stage 3).

Cost (counted by ``checks()``): one all-reduce of 16 bytes per collective that goes through the
backend (for a stage-3 step on gloo: one per gather, one per gradient bucket, one for the step's
values); none through shared memory.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict

import torch
import torch.distributed as dist

from . import diagnose, waiting


class CollectiveMismatchError(RuntimeError):
    """The ranks made different collectives (kind, dtype or sizes) at the same point: their
    programs diverged."""


# identity -> its description, for the error (a few distinct collectives per model)
_described: dict[int, str] = {}
_count = [0]  # checks made by this process (the check's cost, measured)
_pending: dict[torch.device, torch.Tensor] = {}  # device -> [1] int64: mismatches not yet read
_LABEL_BYTES = 2048


def identity(kind: str, dtype: torch.dtype, shape) -> int:
    """A 31-bit identity of a collective: its kind, dtype and sizes, the same on every rank that
    makes the same collective."""
    text = f"{kind} of {str(dtype).replace('torch.', '')} {list(shape)}"
    ident = zlib.crc32(text.encode()) & 0x7FFFFFFF
    _described.setdefault(ident, text)
    return ident


def describe(ident: int) -> str:
    """The collective an identity stands for, as this rank made it."""
    return _described.get(ident, f"collective #{ident}")


def checks() -> int:
    """How many identity checks this process made (each one all-reduce of 16 bytes, or a
    shared-memory sync that carried it)."""
    return _count[0]


def flag(ident: int, device: torch.device) -> torch.Tensor:
    """``[identity, -identity]`` (int64) made on ``device`` from scalars (no upload from the host)."""
    out = torch.empty(2, dtype=torch.int64, device=device)
    out[0].fill_(ident)
    out[1].fill_(-ident)
    return out


def agreed(reduced: torch.Tensor) -> bool:
    """After the MAX all-reduce of every rank's ``flag``: True when every rank brought the same
    identity (read on the host: a CPU tensor)."""
    _count[0] += 1
    high, low = reduced.tolist()
    return high == -low


def count_on_device(reduced: torch.Tensor) -> None:
    """After the MAX all-reduce on a device the host must not wait for: add ``max - min`` (0 when
    the ranks agreed) to the device's pending count, read later (``pending``)."""
    _count[0] += 1
    found = _pending.get(reduced.device)
    if found is None:
        found = _pending[reduced.device] = torch.zeros(1, dtype=torch.int64, device=reduced.device)
    found.add_(reduced.sum())


def pending(device: torch.device):
    """The device's count of checks whose ranks disagreed, not yet read (a [1] int64 tensor), or
    None when no check ran there."""
    return _pending.get(device)


def mismatch(what: str, ident: int, group, exchange) -> BaseException:
    """The error for a check whose ranks disagreed; every rank of ``group`` calls this together.
    ``exchange(tensor)`` all-gathers a uint8 row of every rank (without a check of its own)."""
    me = diagnose.current("failed", f"{what}: {describe(ident)}")
    raw = json.dumps(asdict(me)).encode()[:_LABEL_BYTES]
    row = torch.zeros(_LABEL_BYTES, dtype=torch.uint8)
    row[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    records = {}
    for r, got in enumerate(exchange(row)):
        text = bytes(got.tolist()).rstrip(b"\0").decode(errors="replace")
        try:
            records[r] = diagnose.Progress(**json.loads(text))
        except (ValueError, TypeError):
            records[r] = diagnose.Progress("failed", where=text)
    rank = dist.get_rank(group)
    table = "\n".join(
        f"  rank {r}{' (this rank)' if r == rank else ''}: {p.describe()}"
        for r, p in sorted(records.items())
    )
    uneven = diagnose.uneven_forwards(records)
    if uneven:
        error: BaseException = diagnose.RanksOutOfStepError(
            f"zengine: rank {rank}: {uneven}\n{table}\n{diagnose.UNEVEN_FORWARDS_ADVICE}"
        )
    else:
        stage3 = any("stage-3 gather" in p.where for p in records.values())
        error = CollectiveMismatchError(
            f"zengine: {what}: the ranks made different collectives at this point (caught by "
            f"the collectives' identity check, before any data moved); their programs "
            f"diverged:\n{table}"
            + (f"\n{diagnose.STAGE3_HINT}\n{waiting.STAGE3_HINT}" if stage3 else "")
        )
    return error
