"""Calls every rank must make together: the ranks meet before the call's first collective.

``save_checkpoint``, ``load_checkpoint``, ``save_16bit_model``, stage 3's ``summon_full_params`` and
``GatheredParameters``, the ``safe_get_full_*`` family: each runs collectives, so every rank of the
group must call it, in the same order. A script that calls one on some ranks only (``if rank == 0:
engine.save_checkpoint(...)``, a gather for logging on rank 0) would pair that call's collectives with
whatever the other ranks run next: garbage values when the sizes happen to match, an abort inside the
backend when they do not, a hang on NCCL. So before its first collective such a call meets the other
ranks in the process group's key-value store, which needs no collective:

    zengine/<attempt>/call/<group>/<n>        counter: how many ranks entered their n-th such call
    zengine/<attempt>/call/<group>/<n>/<r>    the call rank r made as its n-th (its label)
    zengine/<attempt>/call/<group>/<n>/label/<l>  counter: how many ranks entered call l as their n-th
    zengine/<attempt>/call/<group>/<n>/all    set by the last rank in: 1 everyone is in the same call, else 0

The last rank in compares its label's count with the group's size and sets ``all`` to 1 (every rank
is in the same call) or 0 (they are not: ``CollectiveCallError`` on every rank, naming each rank's
call). A rank waits for ``all``; meanwhile it looks (slowly, only after the fast path failed) whether
a rank left the job and whether the group's timeout expired. A rank that is waiting in
one of the training step's collectives on gloo looks whether a peer entered a call this rank has not
(``stranded``, from ``collectives.Pending.wait``): it raises at once, naming the call its peer is in,
and its failure record ends the peer's wait with an error too. On NCCL that rank is freed by the
backend's own timeout instead. Calls nested inside another such call meet once, at the outermost.

The cost on the normal path: a few store round trips per call (set, two adds, a check), no collective.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import diagnose

_PREFIX = "zengine/" + diagnose._ATTEMPT + "/call/"
_calls: dict[str, int] = {}  # group key -> collective calls this rank has entered in that group
_depth = [0]  # nesting: only the outermost call meets


class CollectiveCallError(RuntimeError):
    """The ranks were not all in the same collective call (one called it on some ranks only)."""


def _group_key(group) -> tuple[str, list[int]]:
    """A store-safe key for ``group`` and its global ranks (the default group: ``world``)."""
    if group is None or group is dist.GroupMember.WORLD:
        return "world", list(range(dist.get_world_size()))
    ranks = sorted(dist.get_process_group_ranks(group))
    return "g" + "-".join(map(str, ranks)), ranks


def _timeout_seconds(group) -> float:
    """The group's collective timeout (comm_timeout), read from its backend; 300 s when unreadable."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:
            continue
    return 300.0


@contextlib.contextmanager
def collective_call(label: str, group=None):
    """Inside: ``label``, a call every rank of ``group`` must make together, after the ranks met."""
    if (
        _depth[0] == 0
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group) > 1
    ):
        _meet(label, group)
    _depth[0] += 1
    try:
        with diagnose.activity(label):
            yield
    finally:
        _depth[0] -= 1


def _meet(label: str, group) -> None:
    store = diagnose.default_store()
    if store is None:
        return
    key, ranks = _group_key(group)
    n = _calls[key] = _calls.get(key, 0) + 1
    me = dist.get_rank()
    base = f"{_PREFIX}{key}/{n}"
    store.set(f"{base}/{me}", label)
    store.add(
        f"{base}/label/{label}", 1
    )  # before the total: when the total is full, every label is counted
    if store.add(base, 1) == len(ranks):
        agreed = store.add(f"{base}/label/{label}", 0) == len(ranks)
        store.set(f"{base}/all", "1" if agreed else "0")
        if n > 1:
            _forget(store, f"{_PREFIX}{key}/{n - 1}", ranks)  # every rank is past call n-1
    deadline = time.monotonic() + _timeout_seconds(group)
    pause = 0.0005
    while not store.check([f"{base}/all"]):
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        if pause < 0.05:
            continue  # the first ~50 ms: just the fast check
        if diagnose.peer_departed() or time.monotonic() > deadline:
            entries = _entries(store, base, ranks)
            _raise_missing(label, ranks, me, entries, timed_out=time.monotonic() > deadline)
    if store.get(f"{base}/all") != b"1":
        raise CollectiveCallError(
            f"zengine: the ranks are in different collective calls (each rank's call number {n}):\n"
            + _table(ranks, me, _entries(store, base, ranks), "?")
            + "\n"
            + _ADVICE
        )


def _entries(store, base: str, ranks: list[int]) -> dict[int, str]:
    """rank -> the call it entered as this number (failure path only: one store read per rank)."""
    return {r: store.get(f"{base}/{r}").decode() for r in ranks if store.check([f"{base}/{r}"])}


def _raise_missing(
    label: str, ranks: list[int], me: int, entries: dict[int, str], timed_out: bool
) -> None:
    """A peer left the job (its record says where), or the timeout expired: raise naming every rank."""
    records = diagnose.exchange(
        diagnose.current("failed", f"{label} (waiting for every rank to call it)"),
        me,
        dist.get_world_size(),
    )
    lines = []
    for r in ranks:
        if r in entries:
            lines.append(f"  rank {r}{' (this rank)' if r == me else ''}: in {entries[r]}")
        elif r in records:
            lines.append(f"  rank {r}: never called it; " + records[r].describe())
        else:
            lines.append(f"  rank {r}: never called it (no report: busy elsewhere, or stopped)")
    why = (
        "the collective timeout expired"
        if timed_out
        else "a rank that never called it failed or left"
    )
    uneven = diagnose.uneven_forwards(records)
    error: RuntimeError = CollectiveCallError(
        f"zengine: rank {me} called {label}, which every rank must call together, and "
        f"{why}:\n" + "\n".join(lines) + "\n" + _ADVICE
    )
    if uneven:  # the cause: a rank still gathers for forwards its peers did not run
        error = diagnose.RanksOutOfStepError(
            f"zengine: rank {me} called {label}, but {uneven}\n"
            + "\n".join(lines)
            + "\n"
            + diagnose.UNEVEN_FORWARDS_ADVICE
            + " If instead the call was made on some ranks only: "
            + _ADVICE
        )
    diagnose.set_reported(error)
    raise error


def _table(ranks: list[int], me: int, entries: dict[int, str], absent: str) -> str:
    return "\n".join(
        f"  rank {r}{' (this rank)' if r == me else ''}: {entries.get(r, absent)}" for r in ranks
    )


_ADVICE = (
    "Calls that run collectives (save_checkpoint, load_checkpoint, save_16bit_model, summon_full_params "
    "and GatheredParameters at stage 3, safe_get_full_*/safe_set_full_*) must be made by every rank, in "
    "the same order, not under `if rank == 0:`; to write or print on one rank only, make the call on "
    "every rank and test the rank inside it (summon_full_params(rank0_only=True) gathers to rank 0)."
)


def _forget(store, base: str, ranks: list[int]) -> None:
    """Drop a finished call's keys (the store would otherwise grow by a few keys per call)."""
    try:
        if not store.check([f"{base}/{ranks[0]}"]):  # (a get would wait for a missing key)
            return
        label = store.get(f"{base}/{ranks[0]}").decode()  # the ranks agreed on call n-1: one label
        for k in [base, f"{base}/all", f"{base}/label/{label}"] + [f"{base}/{r}" for r in ranks]:
            store.delete_key(k)
    except Exception:  # a store without delete: the keys stay, harmlessly
        pass


def stranded() -> Optional[str]:
    """Checked by a rank whose collective has waited a while: the call a peer entered that this rank has
    not (so the peer will not join this rank's collective), else None. One store round trip per group."""
    if not _calls and not (dist.is_available() and dist.is_initialized()):
        return None
    store = diagnose.default_store()
    if store is None:
        return None
    for key in set(_calls) | {"world"}:
        base = f"{_PREFIX}{key}/{_calls.get(key, 0) + 1}"
        try:
            if store.check([base]):
                return _who_entered(store, base)
        except Exception:
            return None
    return None


def _who_entered(store, base: str) -> str:
    world = dist.get_world_size()
    names = _entries(store, base, list(range(world)))
    who = ", ".join(f"rank {r} in {label}" for r, label in sorted(names.items()))
    return f"a peer entered a collective call that this rank has not made ({who or 'a collective call'})."


def stranded_error(what: str, elsewhere: str) -> BaseException:
    """The error for a rank left waiting in ``what`` because a peer is in a collective call: this rank's
    failure record is published first, which ends the peer's wait with its own error."""
    if diagnose.first_reported() is not None:
        return diagnose.first_reported()
    rank, world = dist.get_rank(), dist.get_world_size()
    records = diagnose.exchange(diagnose.current("failed", what), rank, world)
    table = "\n".join(
        f"  rank {r}{' (this rank)' if r == rank else ''}: "
        + (records[r].describe() if r in records else "no report")
        for r in range(world)
    )
    uneven = diagnose.uneven_forwards(records)
    error: RuntimeError = (
        diagnose.RanksOutOfStepError(
            f"zengine: rank {rank} was waiting in {what}, but {uneven}\n{table}\n"
            + diagnose.UNEVEN_FORWARDS_ADVICE
            + " If instead a peer made a collective call on its own: "
            + _ADVICE
        )
        if uneven
        else CollectiveCallError(
            f"zengine: rank {rank} was waiting in {what}, but {elsewhere}\n{table}\n{_ADVICE}"
        )
    )
    diagnose.set_reported(error)
    return error
