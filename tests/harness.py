"""One harness for distributed tests: spawn ``world_size`` gloo ranks on CPU and collect results.

    results = spawn(fn, world_size, *args)   # fn(*args) runs on every rank; list indexed by rank

``fn`` must be a module-level function (it is pickled by reference). The
process group is up when it runs; whatever it returns must pickle. A failure
on any rank raises here with that rank's traceback.
"""
from __future__ import annotations

import os
import queue as queue_mod
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(*args)
        results.put((rank, True, out))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue_mod.Empty:
                errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(out))}")
                break
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
