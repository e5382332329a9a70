"""Binding each rank to its own CPU cores (``--bind_cores_to_rank``, ``--bind_core_list``), as
DeepSpeed's launcher does.

Ranks of one host that share every core fight over them: each process's intra-op threads, the
CPU-Adam of ZeRO-Offload and gloo's threads all assume the machine is theirs, and the step slows by
the contention (DeepSpeed reports ~1.3x from binding). With ``--bind_cores_to_rank`` the cores
(``--bind_core_list``, e.g. ``0-15,32-47``, or else every physical core ``0..P-1``) are cut into
``len // ranks`` consecutive cores per local rank; each rank pins itself to its share
(``os.sched_setaffinity``) and runs that many threads (``OMP_NUM_THREADS``,
``torch.set_num_threads``) before the user's script starts. DeepSpeed prefixes ``numactl -C``;
pinning from inside the rank needs no extra package and works the same under ``torchrun``'s agent.
Memory follows the cores by Linux's first-touch placement (DeepSpeed adds ``numactl -m``).

The launcher passes the list to its ranks as ``ZENGINE_BIND_CORES``; ``entry.py`` applies it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import psutil

BIND_CORES_ENV = "ZENGINE_BIND_CORES"  # the node's core list, e.g. "0-15,32-47"


class CoreBindingError(ValueError):
    """A core list that cannot be parsed or shared among the ranks; the message names it."""


def parse_core_list(text: str) -> list[int]:
    """``"1,3-5,7"`` -> ``[1, 3, 4, 5, 7]``; ranges ascending and not overlapping, as DeepSpeed's."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise CoreBindingError(
                f"--bind_core_list {text!r}: {part!r} is not a core number or a range a-b"
            ) from None
        if lo < 0 or hi < lo:
            raise CoreBindingError(f"--bind_core_list {text!r}: {part!r} is not an ascending range")
        if cores and lo <= cores[-1]:
            raise CoreBindingError(
                f"--bind_core_list {text!r}: {part!r} overlaps or precedes the range before it "
                "(list ranges in ascending order)"
            )
        cores.extend(range(lo, hi + 1))
    return cores


def default_core_list() -> str:
    """Every physical core, ``0..P-1`` (DeepSpeed's default when no list is given)."""
    physical = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return f"0-{physical - 1}"


def cores_for_rank(cores: Sequence[int], local_ranks: int, local_rank: int) -> list[int]:
    """The consecutive share of ``cores`` of ``local_rank`` among ``local_ranks`` ranks."""
    per_rank = len(cores) // local_ranks
    if per_rank < 1:
        raise CoreBindingError(
            f"--bind_cores_to_rank: {len(cores)} core(s) cannot give each of {local_ranks} ranks "
            "one; name more cores in --bind_core_list or start fewer processes per node"
        )
    return list(cores[per_rank * local_rank : per_rank * (local_rank + 1)])


def bind_this_rank(environ: Mapping[str, str]) -> list[int]:
    """Pin this process to its share of ``ZENGINE_BIND_CORES`` (a no-op without it); its cores."""
    text = environ.get(BIND_CORES_ENV)
    if not text:
        return []
    local_ranks = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = cores_for_rank(parse_core_list(text), local_ranks, int(environ.get("LOCAL_RANK", "0")))
    usable = os.sched_getaffinity(0)
    missing = [c for c in mine if c not in usable]
    if missing:
        raise CoreBindingError(
            f"--bind_cores_to_rank: core(s) {missing} of this rank's share {mine} are not "
            f"available to this process (it may run on {sorted(usable)}); fix --bind_core_list"
        )
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # for the libraries the script starts
    import torch

    torch.set_num_threads(len(mine))
    return mine
