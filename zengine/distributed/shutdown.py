"""A clean end to a training process: nothing of zengine's or the backend's still running when
the interpreter shuts down.

Why this exists: a gloo process group runs worker threads. When one of them drops the last
reference to a finished collective whose tensor Python no longer holds (a temporary handed to
``all_gather``, a buffer freed right after ``wait()``; a ``barrier`` keeps earlier collectives
alive until it is dropped too), it must take the GIL to free that tensor's Python object. If
the interpreter is already finalising, CPython ends such a thread on the spot, which C++
reports as "terminate called without an active exception" and a SIGABRT, after a run that
had finished. ``destroy_process_group`` joins those threads only when nothing else holds the
group, and torch itself keeps references to it once any optimizer has been built (its
compiler's imports register the group), so a script that calls it is not safe either.

And a rank that fails while a collective is in flight cannot end either: the backend's
threads wait in that collective for peers that never join, and the interpreter's shutdown waits
for them, so the failed rank hangs until its peers are killed or time out, and the launcher,
which stops the job only when a rank has exited, waits too.

So, at exit (``atexit`` runs before finalisation, with the interpreter whole):
- after a clean end, every live engine finishes its pending collectives and releases its hooks,
  files and I/O threads (``Engine.destroy``), the process group is destroyed when zengine
  created it, and the backend's threads get the GIL long enough to drop what they still hold;
- after an uncaught exception (its traceback already printed) the process flushes its output
  and ends at once with Python's exit status, waiting for nothing, so that the launcher sees
  the failure now and stops the other ranks.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
import weakref

import torch.distributed as dist

from . import diagnose

# How long the backend's worker threads get the GIL at exit. They are already waiting for it
# when there is anything to free (their collectives completed before the last Python call
# returned), so a few milliseconds are plenty; 50 ms is small beside any process start-up.
_DRAIN_SECONDS = 0.05

_engines: "weakref.WeakSet" = weakref.WeakSet()
_state = {"registered": False, "owns_group": False, "tracked": False}


def track(engine) -> None:
    """Have ``engine.destroy()`` run at exit if the script does not call it."""
    _engines.add(engine)
    _state["tracked"] = True
    _register()


def created_process_group() -> None:
    """zengine started the default process group: it also destroys it at exit."""
    _state["owns_group"] = True
    _register()


def _register() -> None:
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(shutdown)


def shutdown() -> None:
    """At exit: after a clean end finish every engine, destroy the process group zengine created
    and let the backend's threads drain; after an uncaught exception end the process now."""
    failure = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if failure is not None:
        if dist.is_available() and dist.is_initialized():
            diagnose.linger_before_exit()
            _exit_now(130 if isinstance(failure, KeyboardInterrupt) else 1)
        return
    for engine in list(_engines):
        try:
            engine.destroy()
        except Exception:  # exiting anyway; a failure here must not hide the script's own outcome
            pass
    grouped = dist.is_available() and dist.is_initialized()
    store = diagnose.default_store() if grouped else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
    me = diagnose.current("exited")
    # A process that trained with an engine leaves its record before the group goes, so that a peer left
    # waiting in a collective (it ran more steps) can say why; the peers' records are read afterwards.
    report = (
        world > 1 and store is not None and _state["tracked"] and diagnose.publish(store, rank, me)
    )
    if _state["owns_group"] and grouped:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    _state["owns_group"] = False
    if report:
        problem = diagnose.check_clean_exit(store, me, rank, world)
        if problem is not None:
            print(problem, file=sys.stderr)
            time.sleep(
                diagnose.LINGER_SECONDS
            )  # the failed rank is printing its own account: let it finish
            _exit_now(1)
    gc.collect()  # engines and works caught in reference cycles, freed while the GIL can still be shared
    time.sleep(
        _DRAIN_SECONDS
    )  # releases the GIL: worker threads waiting on it finish their frees now


def _exit_now(status: int) -> None:
    """End the process without waiting for threads (the traceback is already on stderr)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)
