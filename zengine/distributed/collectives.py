"""Thin, stateless collective functions over torch.distributed.

The engine calls collectives only through this module, so that tests can
patch them and the choice of collective per backend lives in one place.
The choice follows measurement, not names: on gloo (CPU) a broadcast from
each owner moves a sharded buffer to every rank about three times faster
than ``all_gather``, and ``all_reduce`` is faster than ``reduce_scatter``
(see shared/MEASURED.md and benchmarks/); NCCL takes the native tensor
collectives on flat buffers (``all_gather_single`` / ``reduce_scatter_single``,
named ``*_into_tensor`` / ``*_tensor`` before torch 2.13).

Every tensor handed to a collective is checked against what its group's
backend can communicate (NCCL: CUDA only), so that a tensor made on the
wrong device fails here, naming the collective, rather than deep inside the
backend or, worse, on a GPU cluster only. A collective the backend fails
(a timeout, a peer gone) is turned into an error that names it and says
where every rank was (``diagnose.py``); asynchronous collectives return a
``Pending`` whose ``wait()`` does the same. Every collective that goes through the backend is
preceded by its identity check (``identity.py``: ranks that make different collectives are named
on every rank before the payload moves); through shared memory the piece's sync carries it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import agreement, diagnose, identity, shm, traffic, waiting
from .process_group import backend_device_types


# On gloo a wait is cut into slices of this length; between slices the rank looks whether a peer
# has left the job (diagnose.peer_departed), which no collective would ever tell it.
_WAIT_SLICE = timedelta(seconds=1)


class Pending:
    """A collective in flight. ``wait()`` blocks until it completes; a backend failure, or on gloo
    a peer that left the job meanwhile, raises a diagnosed error naming the collective."""

    __slots__ = ("work", "what", "watched", "group")

    def __init__(self, work, what: tuple, watched: bool, group=None):
        self.work, self.what, self.group = (
            work,
            what,
            group,
        )  # what: (name, shape, dtype), formatted only on failure
        # Sliced waits only on gloo: on NCCL wait() only orders streams, and a wait with a timeout
        # would block the host on every bucket (its own watchdog handles timeouts there).
        self.watched = watched

    def wait(self) -> None:
        if not self.watched:
            try:
                self.work.wait()
            except RuntimeError as err:
                raise diagnose.collective_failed(_describe(self.what), err) from err
            return
        long_wait = (
            None  # made after the first slice (most waits end inside it), told to the peers later
        )
        while True:
            try:
                self.work.wait(timeout=_WAIT_SLICE)
                if long_wait is not None:
                    long_wait.done()
                return
            except RuntimeError as err:
                if self.work.is_completed():  # the collective itself failed (not just this slice)
                    raise diagnose.collective_failed(_describe(self.what), err) from err
            # a peer waits in a call every rank must make: it will not come here (the cause, so named first)
            elsewhere = agreement.stranded()
            if elsewhere:
                raise agreement.stranded_error(_describe(self.what), elsewhere)
            departed = diagnose.peer_departed()
            long_wait = long_wait or waiting.LongWait(_describe(self.what), self.group)
            long_wait.tick(
                compare_now=departed
            )  # ranks waiting in different collectives: a deadlock, named
            if departed:
                raise diagnose.collective_failed(
                    _describe(self.what),
                    diagnose.PeerLeft("a peer rank finished or failed while this rank waited"),
                )


Work = Optional[Pending]


def _describe(what: tuple) -> str:
    name, shape, dtype = what
    return f"the collective {name} of a {list(shape)} {str(dtype).replace('torch.', '')} tensor"


def _run(
    name: str, tensor: torch.Tensor, call, *args, async_op: bool = False, group=None, **kwargs
):
    """``call(*args, **kwargs)``: a Pending when ``async_op``, else None; backend failures diagnosed.

    On gloo a blocking collective is started asynchronously and waited for in slices (``Pending``).
    """
    what = (name, tuple(tensor.shape), tensor.dtype)
    watched = is_gloo(group)
    try:
        work = call(*args, async_op=async_op or watched, group=group, **kwargs)
    except RuntimeError as err:
        raise diagnose.collective_failed(_describe(what), err) from err
    if work is None:
        return None
    pending = Pending(work, what, watched, group)
    if async_op:
        return pending
    pending.wait()
    return None


# torch 2.13 renamed the flat-buffer collectives; older versions have only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class WrongDeviceError(RuntimeError):
    """A tensor was handed to a collective on a device its process group's backend cannot communicate."""


def backend(group=None) -> str:
    """The group's backend name ("gloo", "nccl", ...)."""
    return dist.get_backend(group)


def is_gloo(group=None) -> bool:
    """True when the group's backend is gloo (the CPU path)."""
    return backend(group) == "gloo"


def check_devices(what: str, group, *tensors: torch.Tensor) -> None:
    """Raise ``WrongDeviceError`` when a tensor is on a device the group's backend does not take."""
    allowed = backend_device_types(backend(group))
    if allowed is None:
        return
    for t in tensors:
        if t.device.type not in allowed:
            raise WrongDeviceError(
                f"zengine.distributed.collectives.{what}: a {t.device.type} tensor {tuple(t.shape)} {t.dtype} was "
                f"given to the {backend(group)} backend, which takes {'/'.join(allowed)} "
                f"tensors; it must be made on the compute device"
            )


def run_blocking(name: str, tensor: torch.Tensor, call, *args, group=None) -> None:
    """``call(*args)``, a collective of ``tensor`` on ``group``, waited for (failures diagnosed as any).
    No identity check of its own: for the shared-memory sync, which is one."""
    _run(name, tensor, call, *args, group=group)


def _all_reduce_max(tensor: torch.Tensor, **kwargs):
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, **kwargs)


def check_identity(kind: str, tensor: torch.Tensor, group=None, shape=None) -> None:
    """The identity check before ``tensor``'s collective ``kind`` through the backend
    (``identity.py``): one MAX all-reduce of ``[identity, -identity]`` on ``tensor``'s device. A
    CPU check is read at once and a mismatch raised on every rank; a device one is counted on
    the device (``identity.pending``), with no host read."""
    if dist.get_world_size(group) == 1:
        return
    ident = identity.identity(kind, tensor.dtype, tensor.shape if shape is None else shape)
    flag = identity.flag(ident, tensor.device)
    # described as the payload's collective: a rank that never comes is waited for here
    _run(kind, tensor, _all_reduce_max, flag, group=group)
    if flag.device.type != "cpu":
        identity.count_on_device(flag)
    elif not identity.agreed(flag):
        raise identity.mismatch(kind, ident, group, lambda row: exchange_rows(row, group))


def exchange_rows(row: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``row`` (a CPU tensor), by rank, with no identity check: for the check's own
    failure path, which every rank reaches together."""
    device = message_device(group)
    mine = row.to(device)
    out = torch.empty((dist.get_world_size(group), *row.shape), dtype=row.dtype, device=device)
    if is_gloo(group):
        _run("all_gather", out, dist.all_gather, list(out.unbind(0)), mine, group=group)
    else:
        _run("all_gather", out, _all_gather_flat, out.view(-1), mine.view(-1), group=group)
    return list(out.cpu().unbind(0))


def all_reduce_sum(tensor: torch.Tensor, group=None, async_op: bool = False) -> Work:
    """Sum ``tensor`` in place over the group (through shared memory where ``shm.py`` is installed: done
    before this returns)."""
    check_devices("all_reduce_sum", group, tensor)
    traffic.record("all_reduce", tensor.numel() * tensor.element_size(), group)
    transport = _shared_memory(group, tensor)
    if transport is not None:
        transport.all_reduce_sum(tensor)
        return None
    check_identity("all_reduce", tensor, group)
    return _run(
        "all_reduce",
        tensor,
        dist.all_reduce,
        tensor,
        op=dist.ReduceOp.SUM,
        group=group,
        async_op=async_op,
    )


def reduce_sum_to(tensor: torch.Tensor, dst: int, group=None, async_op: bool = False) -> Work:
    """Sum ``tensor`` over the group into rank ``dst`` (others keep garbage)."""
    check_devices("reduce_sum_to", group, tensor)
    traffic.record("reduce", tensor.numel() * tensor.element_size(), group)
    check_identity(f"reduce to {dst}", tensor, group)
    return _run(
        "reduce",
        tensor,
        dist.reduce,
        tensor,
        dst=dst,
        op=dist.ReduceOp.SUM,
        group=group,
        async_op=async_op,
    )


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False) -> Work:
    """Copy ``tensor`` from rank ``src`` to every rank of the group."""
    check_devices("broadcast", group, tensor)
    traffic.record("broadcast", tensor.numel() * tensor.element_size(), group)
    check_identity(f"broadcast from {src}", tensor, group)
    return _run(
        "broadcast", tensor, dist.broadcast, tensor, src=src, group=group, async_op=async_op
    )


def all_gather_rows(rows: torch.Tensor, rank: int, group=None, async_op: bool = False) -> list:
    """Fill row r of ``rows`` ([world, n], contiguous) on every rank from rank r's own row r.

    gloo: one broadcast per owner (measured about three times faster than its all_gather; each row
    must be contiguous, the rows need not be); otherwise one flat all-gather in place (this rank's
    row is the input). Returns the pending works when ``async_op``.
    """
    if rows.shape[0] == 1:
        return []
    check_devices("all_gather_rows", group, rows)
    traffic.record("all_gather", rows.numel() * rows.element_size(), group)
    transport = shm.for_group(group)
    if transport is not None and transport.takes(
        rows
    ):  # shared memory (shm.py): done before this returns
        transport.all_gather_rows(rows)
        return []
    check_identity("all_gather", rows, group)
    if is_gloo(group):
        works = [
            _run(
                "broadcast (all-gather by rows)",
                rows,
                dist.broadcast,
                row,
                src=_global_rank(r, group),
                group=group,
                async_op=True,
            )
            for r, row in enumerate(rows.unbind(0))
        ]
    else:
        assert rows.is_contiguous(), "all_gather_rows needs one contiguous [world, n] buffer"
        works = [
            _run(
                "all_gather",
                rows,
                _all_gather_flat,
                rows.view(-1),
                rows[rank],
                group=group,
                async_op=True,
            )
        ]
    works = [w for w in works if w is not None]
    if async_op:
        return works
    for w in works:  # all started, then waited: the broadcasts overlap
        w.wait()
    return []


def gather_strided(
    full: torch.Tensor, shard_numel: int, lo: int, hi: int, rank: int, world: int, group=None
) -> None:
    """Gather the sub-range ``[lo, hi)`` of every rank's shard of ``full`` (one all-gather bucket)."""
    if world == 1 or hi <= lo:
        return
    rows = full.narrow(0, 0, world * shard_numel).view(world, shard_numel)[
        :, lo:hi
    ]  # [world, hi - lo]
    # gloo broadcasts row by row (each row is contiguous); a flat all-gather needs the rows end to end,
    # as they are when the bucket is the whole shard: then it gathers straight into the parameters.
    if is_gloo(group) or rows.is_contiguous():
        all_gather_rows(rows, rank, group)
    else:
        staging = torch.empty(
            world, hi - lo, dtype=full.dtype, device=full.device
        )  # [world, hi - lo]
        staging[rank].copy_(rows[rank])
        all_gather_rows(staging, rank, group)
        rows.copy_(staging)


def _shared_memory(group, tensor: torch.Tensor) -> Optional["shm.SharedMemoryTransport"]:
    """``group``'s shared-memory transport (``shm.py``) when it takes ``tensor`` as one contiguous buffer."""
    transport = shm.for_group(group)
    return (
        transport
        if transport is not None and transport.takes(tensor) and tensor.is_contiguous()
        else None
    )


def reduce_scatter_rows(rows: torch.Tensor, rank: int, group=None) -> tuple[list, torch.Tensor]:
    """Row ``rank`` of ``rows`` ([world, n], contiguous) summed over the group, by the cheapest way the group has.

    Returns ``(works, mine)``: once the works are waited for, ``mine`` holds this rank's sum. Through shared
    memory (``shm.py``, CPU ranks on one host): done before this returns, in place (``mine`` is ``rows[rank]``).
    On other gloo groups: an all-reduce of the whole buffer, whose row ``rank`` is kept (measured faster than
    gloo's reduce-scatter). Otherwise (NCCL): a reduce-scatter into a new ``[n]`` tensor. One rank:
    its row is already the sum (no collective, and no ``[n]`` copy beside the bucket).
    """
    if rows.shape[0] == 1:
        return [], rows[0]
    transport = _shared_memory(group, rows)
    if transport is not None:
        check_devices("reduce_scatter_rows", group, rows)
        traffic.record("reduce_scatter", rows.numel() * rows.element_size(), group)
        return [], transport.reduce_scatter_rows(rows)
    if is_gloo(group):
        return [all_reduce_sum(rows, group, async_op=True)], rows[rank]
    out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
    return [reduce_scatter(out, rows.view(-1), group, async_op=True)], out


def reduce_to_owners(
    flat: torch.Tensor, pieces: list[tuple[int, int, int]], rank: int, group=None
) -> list:
    """Sum ``flat`` (1-d) over the group where it matters: ``pieces`` are ``(owner, lo, hi)``, and once the
    returned works are waited for, each owner's ``flat[lo:hi]`` holds the sum (the rest may not).

    Through shared memory (``shm.py``; ``flat`` contiguous and large enough): each rank sums only its own
    pieces, done before this returns. On other gloo groups: an all-reduce of the whole (gloo's reduce is a
    chain of point-to-point sends, measured slower). Otherwise (NCCL): a reduce per piece to its owner.
    """
    transport = _shared_memory(group, flat)
    if transport is not None:
        check_devices("reduce_to_owners", group, flat)
        traffic.record("reduce", flat.numel() * flat.element_size(), group)
        transport.reduce_owned(flat, [(lo, hi) for owner, lo, hi in pieces if owner == rank])
        return []
    if is_gloo(group):
        return [all_reduce_sum(flat, group, async_op=True)]
    return [reduce_sum_to(flat[lo:hi], owner, group, async_op=True) for owner, lo, hi in pieces]


def reduce_scatter(
    out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False
) -> Work:
    """Sum ``full`` ([world * n]) over the group; this rank keeps its n-element part in ``out``."""
    check_devices("reduce_scatter", group, out, full)
    traffic.record("reduce_scatter", full.numel() * full.element_size(), group)
    check_identity("reduce_scatter", full, group)
    return _run(
        "reduce_scatter",
        full,
        _reduce_scatter_flat,
        out,
        full,
        op=dist.ReduceOp.SUM,
        group=group,
        async_op=async_op,
    )


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False) -> Work:
    """Row r of ``inp`` ([world, n]) goes to rank r; row s of ``out`` comes from rank s."""
    check_devices("all_to_all", group, out, inp)
    traffic.record("all_to_all", inp.numel() * inp.element_size(), group)
    check_identity("all_to_all", inp, group)
    return _run("all_to_all", inp, dist.all_to_all_single, out, inp, group=group, async_op=async_op)


def message_device(group=None) -> torch.device:
    """Where small host-side messages (checkpoint metadata, errors) travel for ``group``: the CPU,
    unless the backend takes only accelerator tensors (NCCL), then this process's current device of
    that accelerator."""
    types = backend_device_types(backend(group)) or ("cpu",)
    if "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    accelerator = getattr(torch, kind, None)  # torch.cuda, torch.xpu, ...
    return torch.device(
        kind, accelerator.current_device() if hasattr(accelerator, "current_device") else 0
    )


def all_gather_small(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked by rank, ``[world, *tensor.shape]`` (small control messages).

    The message travels on ``tensor``'s device: make it on the compute device.
    """
    check_devices("all_gather_small", group, tensor)
    world = dist.get_world_size(group)
    out = torch.empty((world, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    traffic.record("all_gather", out.numel() * out.element_size(), group)
    check_identity("all_gather", out, group)
    if is_gloo(group):
        _run(
            "all_gather",
            out,
            dist.all_gather,
            list(out.unbind(0)),
            tensor.contiguous(),
            group=group,
        )
    else:
        _run(
            "all_gather",
            out,
            _all_gather_flat,
            out.view(-1),
            tensor.contiguous().view(-1),
            group=group,
        )
    return out


def global_rank(group_rank: int, group) -> int:
    """The default group's rank of ``group``'s rank ``group_rank``."""
    return _global_rank(group_rank, group)


def _global_rank(group_rank: int, group) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)
