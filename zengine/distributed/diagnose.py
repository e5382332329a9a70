"""Naming what went wrong when a collective fails: which collective, where each rank was.

A collective that never completes says nothing by itself: the backend raises a timeout (gloo:
"Timed out waiting ...") or a closed connection on the ranks that were waiting, and the rank
that caused it is elsewhere: stopped, hung, busy in a loop of its own, or finished and gone
because it ran fewer steps. So that every rank can say which, each rank leaves a short record
in the process group's key-value store (the one the ranks met through; it outlives any
collective):

    zengine/<attempt>/rank/<r> = {"state": "failed", "where": <collective>, "global_steps", "micro_steps"}
                     | {"state": "exited", "global_steps", "micro_steps"}      (a clean end)

A rank that leaves a record also bumps a counter, ``zengine/<attempt>/departed``; a rank waiting in a
collective on gloo looks at it once per second of waiting (``collectives.Pending.wait``), so that a
peer that finished early, or failed elsewhere, ends the wait at once instead of at the timeout.
A rank whose collective fails writes its record, reads the others' for a few seconds, and
raises one error naming each rank's state: ``RanksOutOfStepError`` when a rank had already
finished (it ran fewer steps: a skipped batch, a data loader of another length), else
``CollectiveTimeoutError``, where a rank with no record is one that never reached the
collective. A rank that ends cleanly leaves its record and reads the others' in the same way
(``shutdown.py``): if one failed, or finished at another step, the clean rank fails too, so
the whole job reports the fault.

Nothing here runs on the training path: only when a collective has already failed, or at exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

# How long a rank waits for the others' records. Ranks that reached the failed collective
# fail within moments of each other; a rank still missing after this is named as such.
GRACE_SECONDS = 5.0
LINGER_SECONDS = 1.0
# Keys carry the elastic restart attempt: torch's elastic agent may keep one store across restarts,
# and a restarted rank must not read the records the killed attempt left (e.g. "rank 0 failed").
_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
_KEY = "zengine/" + _ATTEMPT + "/rank/{}"
_DEPARTED = "zengine/" + _ATTEMPT + "/departed"

# Markers of a communication failure in the backends' messages (as opposed to a program error
# raised while calling a collective, such as a wrong device).
_BACKEND_FAILURES = (
    "Timed out",
    "timed out",
    "timeout",
    "Timeout",
    "Connection closed",
    "Connection reset",
    "pair closure",
    "Broken pipe",
    "NCCL",
)


class RanksOutOfStepError(RuntimeError):
    """The ranks ran different numbers of steps (one skipped or repeated a batch)."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete on every rank: some rank never reached it."""


class PeerLeft(RuntimeError):
    """Raised into a waiting rank's diagnosis: a peer finished or failed while it waited."""


@dataclass
class Progress:
    """Where a rank is: its engine's counters and, when failing, the collective it waited in."""

    state: str  # "running", "failed" or "exited"
    global_steps: int = 0
    micro_steps: int = 0
    where: str = ""
    # stage 3: forwards run so far, [with gradients, without] (empty: not counted)
    forwards: list = field(default_factory=list)

    def describe(self) -> str:
        if self.state == "exited":
            return (
                f"finished and left the job after {self.global_steps} optimizer step(s) "
                f"({self.micro_steps} micro-step(s)){self._forwards()}"
            )
        return (
            f"failed in {self.where}, in micro-step {self.micro_steps + 1} "
            f"(after {self.global_steps} optimizer step(s)){self._forwards()}"
        )

    def _forwards(self) -> str:
        if not self.forwards:
            return ""
        grad, no_grad = self.forwards
        return f"; {grad + no_grad} forward(s) so far, {no_grad} of them without gradients"


# The engine registers how to read its counters; without an engine the counters read 0.
_progress: dict[str, Callable[[], tuple[int, int]]] = {}
# Stage 3 registers how to read its forward counts ([with gradients, without]): each forward
# gathers with collectives, so ranks that ran different numbers of them fall out of step.
_forwards: dict[str, Callable[[], list]] = {}
UNEVEN_FORWARDS_ADVICE = (
    "At stage 3 every forward gathers the parameters with collectives every rank must make, so "
    "every rank must run the same number of forwards. A generation loop in which each rank stops "
    "at its own end-of-sequence (as RLHF loops do) breaks this. The way out: gather the "
    "parameters once around the whole generation (`with engine.summon_full_params():` or "
    "`with zengine.zero.GatheredParameters(list(engine.module.parameters())):`; no gathers run "
    "inside), or keep every rank forwarding until the longest sequence is done (pad the finished "
    "ones: Hugging Face's generate(..., synced_gpus=True) does this)."
)
# What the rank is doing, read only when a collective fails: the public calls that run collectives
# (save_checkpoint, summon_full_params, GatheredParameters...) push their name, and stage 3 registers
# where its gathers are. A timeout then names, for each rank, the call it was in: a collective call
# that only some ranks made (under `if rank == 0:`) shows as two ranks in two different calls.
_activities: list[str] = []
_positions: dict[str, Callable[[], str]] = {}
STAGE3_HINT = (
    "Ranks at different stage-3 gathers ran different modules: if a module runs different "
    "submodules on different ranks (mixture-of-experts routing, data-dependent branches), mark it a "
    "leaf so that its parameters are gathered as one unit whatever runs inside: "
    "zengine.utils.set_z3_leaf_modules(model, [TheModuleClass]) (as deepspeed.utils.set_z3_leaf_modules)."
)


@contextlib.contextmanager
def activity(label: str):
    """Inside: a failed collective on this rank is reported as happening in ``label`` (a public call that
    runs collectives, which every rank must make together)."""
    _activities.append(label)
    try:
        yield
    finally:
        _activities.pop()


def register_position(kind: str, describe: Callable[[], str]) -> None:
    """``describe()`` says where this rank's ``kind`` of work is (stage 3: its latest parameter gather)."""
    _positions[kind] = describe


def context() -> str:
    parts = [f"in {label}" for label in _activities]
    for describe in _positions.values():
        try:
            text = describe()
        except Exception:  # a diagnosis must not fail on its own
            text = ""
        if text:
            parts.append(text)
    return "; ".join(parts)


_reported: list[Optional[BaseException]] = [None]  # the first failure diagnosed in this process
_linger = [
    False
]  # that failure involves ranks that finished and are reading the records at their exit


def track_progress(counters: Callable[[], tuple[int, int]]) -> None:
    """``counters()`` returns (global_steps, micro_steps) of the engine training in this process."""
    _progress["engine"] = counters


def track_forwards(counts: Callable[[], list]) -> None:
    """``counts()`` returns [forwards with gradients, forwards without] of the stage-3 model in
    this process (see ``uneven_forwards``)."""
    _forwards["stage 3"] = counts


def current(state: str, where: str = "") -> Progress:
    counters = _progress.get("engine")
    steps, micro = counters() if counters is not None else (0, 0)
    context = _context_if(state)
    forwards = _forwards.get("stage 3")
    return Progress(
        state,
        steps,
        micro,
        f"{where} ({context})" if context else where,
        list(forwards()) if forwards is not None else [],
    )


def uneven_forwards(records: dict[int, Progress]) -> str:
    """When the ranks' records show different numbers of stage-3 forwards without gradients (a
    generation loop each rank ends at its own end-of-sequence): the sentence that says so (the
    cause of the failure being diagnosed), else "". Training forwards are not compared: a rank
    inside its next one while a peer makes a call on its own differs by that one, which is the
    peer's call's fault (agreement.py names it)."""
    counted = {r: tuple(p.forwards) for r, p in records.items() if p.forwards}
    if len({c[1] for c in counted.values()}) <= 1:
        return ""
    each = ", ".join(
        f"rank {r}: {sum(c)} ({c[1]} without gradients)" for r, c in sorted(counted.items())
    )
    return (
        f"the ranks ran different numbers of forwards at stage 3 ({each}), so their parameter "
        f"gathers no longer pair up: a rank is still gathering for a forward its peers did not run."
    )


def _context_if(state: str) -> str:
    return context() if state == "failed" else ""


def set_reported(error: BaseException) -> None:
    """``error`` is this process's diagnosed failure: later failures (cleaning up) are not diagnosed again."""
    _reported[0] = error


def first_reported() -> Optional[BaseException]:
    """The first failure diagnosed in this process (an error already naming every rank), or None."""
    return _reported[0]


def is_backend_failure(err: BaseException) -> bool:
    """True for a communication failure reported by the backend (timeout, closed connection)."""
    if isinstance(err, PeerLeft):
        return True
    if isinstance(err, (RanksOutOfStepError, CollectiveTimeoutError)):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _BACKEND_FAILURES)


def collective_failed(what: str, err: BaseException) -> BaseException:
    """The error to raise for ``err``, raised by the backend in collective ``what``: a diagnosed one
    naming every rank's state, or ``err`` itself when it is not a communication failure."""
    if not is_backend_failure(err) or not dist.is_initialized():
        return err
    if _reported[0] is not None:  # cleaning up after the first failure: no second round of records
        return err
    rank, world = dist.get_rank(), dist.get_world_size()
    me = current("failed", what)
    records = exchange(me, rank, world)
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    lines = []
    for r in range(world):
        mark = " (this rank)" if r == rank else ""
        lines.append(
            f"  rank {r}{mark}: "
            + (
                records[r].describe()
                if r in records
                else f"no report within {GRACE_SECONDS:g} s: it never reached a collective that failed "
                f"(stopped, hung, or busy outside zengine)"
            )
        )
    table = "\n".join(lines)
    exited = [r for r, p in records.items() if p.state == "exited"]
    uneven = uneven_forwards(records)
    if uneven:  # the cause, whoever left first: a rank gathers for forwards its peers did not run
        error: BaseException = RanksOutOfStepError(
            f"zengine: rank {rank} was waiting in {what}: {uneven}\n{table}\n"
            f"{UNEVEN_FORWARDS_ADVICE} (backend: {first_line})"
        )
        _linger[0] = bool(exited)
    elif exited:
        _linger[0] = True
        error = RanksOutOfStepError(
            f"zengine: rank {rank} was waiting in {what} for rank(s) {exited}, which had already finished: the "
            f"ranks ran different numbers of steps.\n{table}\nEvery rank must run the same number of "
            f"forward/backward/step calls; a rank that skips a batch trains on other data than its peers until "
            f"it runs out. Check data loaders of unequal length and per-rank conditions around "
            f"engine.backward()/engine.step(). (backend: {first_line})"
        )
    else:
        missing = [r for r in range(world) if r not in records]
        error = CollectiveTimeoutError(
            f"zengine: {what} did not complete on rank {rank} ({first_line}); rank(s) {missing or 'none'} "
            f"never arrived.\n{table}\nA rank that never arrives is stopped, hung, or running other "
            f"code than its peers; the wait is bounded by comm_timeout (config) or --comm_timeout (launcher)."
            + (
                "\n" + STAGE3_HINT
                if any("stage-3 gather" in p.where for p in records.values())
                else ""
            )
        )
    _reported[0] = error
    return error


def exchange(me: Progress, rank: int, world: int) -> dict[int, Progress]:
    """Publish this rank's record in the default group's store and read every rank's (rank -> record)."""
    store = default_store()
    if store is None or not publish(store, rank, me):
        return {rank: me}
    return read_records(store, me, rank, world)


def read_records(
    store, me: Progress, rank: int, world: int, grace: float = GRACE_SECONDS
) -> dict[int, Progress]:
    """Every rank's record found within ``grace`` seconds (this rank's is ``me``)."""
    records = {rank: me}
    deadline = time.monotonic() + grace
    while len(records) < world:
        for r in range(world):
            if r in records:
                continue
            try:
                if store.check([_KEY.format(r)]):
                    records[r] = Progress(**json.loads(store.get(_KEY.format(r))))
            except Exception:
                return records
        if len(records) == world or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return records


def linger_before_exit() -> None:
    """Called by a failing rank after its traceback is out: when ranks that finished early are reading
    the records at their exit, give them a moment to read this rank's before its exit makes the
    launcher stop them (so that they report too instead of being killed silently)."""
    if _linger[0]:
        time.sleep(LINGER_SECONDS)


def check_clean_exit(store, me: Progress, rank: int, world: int) -> Optional[str]:
    """At a clean end, with this rank's record ``me`` already published: read the others'. Returns the
    reason this rank must report failure (a peer failed, or finished at another step), or None."""
    records = read_records(store, me, rank, world)
    failed = {r: p for r, p in records.items() if p.state == "failed"}
    other_steps = {
        r: p
        for r, p in records.items()
        if p.state == "exited"
        and (p.global_steps, p.micro_steps) != (me.global_steps, me.micro_steps)
    }
    if not failed and not other_steps:
        return None
    table = "\n".join(
        f"  rank {r}{' (this rank)' if r == rank else ''}: "
        + (records[r].describe() if r in records else "no report")
        for r in range(world)
    )
    return (
        f"zengine: rank {rank} finished, but the job did not: "
        + (
            "rank(s) %s failed" % sorted(failed)
            if failed
            else "rank(s) %s finished at another step" % sorted(other_steps)
        )
        + f"; the ranks ran different numbers of steps or one of them stopped.\n{table}"
    )


def publish(store, rank: int, me: Progress) -> bool:
    """Write this rank's record; False when the store cannot be reached (its host is gone)."""
    try:
        store.set(_KEY.format(rank), json.dumps(asdict(me)))
        store.add(_DEPARTED, 1)
        return True
    except Exception:
        return False


def peer_departed() -> bool:
    """True when some rank has left a record (finished, or failed in a collective): checked by a
    rank that has waited a while in a collective. One store round trip."""
    store = default_store()
    if store is None:
        return False
    try:
        return store.add(_DEPARTED, 0) > 0
    except Exception:  # the store's host is gone: so is the job
        return True


def default_store():
    """The default process group's key-value store, or None."""
    try:
        return dist.distributed_c10d._get_default_store()  # the store the ranks met through
    except Exception:
        return None
