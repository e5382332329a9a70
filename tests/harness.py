"""One harness for distributed tests: spawn ``world_size`` gloo ranks on CPU and collect results.

    results = spawn(fn, world_size, *args)   # fn(*args) runs on every rank; list indexed by rank

``fn`` must be a module-level function (it is pickled by reference). The
process group is up when it runs; whatever it returns must pickle. A failure
on any rank raises here with that rank's traceback.

Ranks are forked from a forkserver that imported torch and zengine once (a
fresh interpreter per rank spent ~1.3 s of the suite's two cores on imports,
hundreds of times); each rank then takes the caller's current environment,
as a spawned process would. A test that measures a rank's resident memory asks for
``start="spawn"``: a forked rank re-faults the library pages its parent had mapped, one code path
at a time, which an upper bound of its own peak would count.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "zengine"]  # imported once, in the forkserver


def _context(start: str):
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world_size, port, backend, environ, env, fn, args, results):
    os.environ.clear()  # the caller's environment now, not the forkserver's from its start
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        out = fn(*args)
        results.put((rank, True, out))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))
    try:
        _leave_together(rank, world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_together(rank: int, world_size: int, wait_s: float = 60.0) -> None:
    """Rank 0 serves the rendezvous store: it stays until every rank is done with it (had it left as soon
    as its own work ended, a peer still reading the store in its last call would be reset). Counted in
    the store, not with a collective: a test may leave the process group broken on purpose."""
    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("harness/done", 1)
        deadline = time.monotonic() + wait_s
        while (
            rank == 0 and store.add("harness/done", 0) < world_size and time.monotonic() < deadline
        ):
            time.sleep(0.002)
    except Exception:  # a peer already gone took its part of the store with it: nothing to wait for
        pass


def spawn(
    fn,
    world_size: int,
    *args,
    timeout: float = 300.0,
    backend: str = "gloo",
    env: dict | None = None,
    start: str = "forkserver",
) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the per-rank results.

    ``backend`` "nccl" puts rank r on cuda:r (tests/cuda); ``env`` overrides each rank's environment
    (a None value removes the variable). A rank that dies without a result (a segfault, a CUDA abort)
    is reported within seconds, not at the timeout. ``start`` "spawn" runs each rank in a fresh
    interpreter (memory measurements).
    """
    ctx = _context(start)
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, environ, env, fn, args, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size and not errors:
            try:
                rank, ok, value = results.get(timeout=min(5.0, timeout))
            except queue_mod.Empty:
                dead = [
                    (r, p.exitcode)
                    for r, p in enumerate(procs)
                    if r not in out and p.exitcode is not None
                ]
                if dead:
                    try:  # its result may still be in the pipe
                        rank, ok, value = results.get(timeout=5)
                    except queue_mod.Empty:
                        errors.append(f"ranks died without a result (rank, exit code): {dead}")
                        break
                elif time.monotonic() > deadline:
                    errors.append(
                        f"timed out after {timeout}s waiting for ranks "
                        f"{sorted(set(range(world_size)) - set(out))}"
                    )
                    break
                else:
                    continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
