"""A stand-in for a GPU on this CPU box: the step path runs on the ``meta`` device with CUDA's device rules.

CI has no GPU, and the device bugs that matter (a tensor made on the host
by default and combined with device tensors; a collective handed a host
tensor; a host read of a device value in the middle of a step) only show on
one. Here the engine computes on ``meta``, a device that is not the host and
holds no data:

- ``DeviceRulesMode`` enforces CUDA's rule on every op: all tensor arguments
  on one device, except 0-dim CPU tensors read as scalars (never as the
  tensor written to); only copies cross devices. (``meta`` itself lets an
  in-place op mix devices, CUDA does not.)
- any read of a device value on the host (``.item()``, ``.tolist()``,
  ``bool(t)``) raises on ``meta``: the step's single intended read,
  ``zengine.distributed.sync.read_to_host``, is replaced by one that counts calls and
  returns plausible values;
- collectives: torch's ``fake`` process group, with the functions that
  ``zengine.distributed.collectives`` calls replaced by stubs that record what they were given
  (``collectives`` itself checks each tensor against the backend's devices; the
  fake backend takes ``cuda`` and ``meta``, as NCCL takes ``cuda``);
- copies between the device and the host (``CopyTally``): a read of a device
  value is not the only way the host waits for the device. Every ``copy_``,
  ``_to_copy`` (``.cpu()``, ``.to("cpu")``, ``.to(device)``) and ``_copy_from``
  that crosses is counted by the kind of wait it costs on CUDA: to the host
  into pinned memory with ``non_blocking`` (queued; the host waits on an event
  when it needs the data) or any other (the host waits now); to the device
  from pinned memory with ``non_blocking`` (queued), from pinned memory
  without (the host waits), or from pageable memory, or converting the dtype
  or from a non-contiguous source (torch then makes a pageable host
  temporary: the host waits). Each is recorded with the zengine line that
  made it;
- pinned host memory (``PinnedMemory``): a CPU-only torch refuses
  ``pin_memory=True`` (no pinned allocator), and ``meta`` tensors have no
  pinning to report. So the mode allocates ordinary host memory for
  ``pin_memory=True`` (any factory), ``.pin_memory()`` and the result of a
  ``non_blocking`` copy to the host (CUDA pins that one), records the
  storage's address range, and answers ``is_pinned()`` from the record (the
  tensors are kept alive for the run, so no pageable tensor reuses an address);
- ``side_streams_on_meta`` gives ``meta`` the CUDA paths of zengine's offload
  copies (``zengine.offload.copies.SIDE_STREAMS``): side streams and events
  (stand-ins that order nothing: meta has no data) and pinned host buffers
  where the config asks for ``pin_memory``; ``side_streams_on_meta(StreamLog())``
  gives it streams and events that log, in order, every record, wait and host
  synchronize asked of them, the copies issued on each stream
  (``DeviceRulesMode.watch``) and, with ``adam_logged``, each CPU-Adam call:
  the order of the offload pipeline, checked by ``tests/offload/test_offload_overlap.py``.

torch's ``FakeTensorMode`` would fake ``cuda`` tensors directly, but on a
CPU-only build its ``copy_`` and ``.data =`` on fake CUDA tensors fail in
C++ (no CUDA device guard), and the engine needs both.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import sys
import types
from collections import Counter
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
# Ops that move data between devices by design.
_CROSSING = {
    aten.copy_,
    aten._to_copy,
    aten._copy_from,
    aten._copy_from_and_resize,
    aten.lift_fresh_copy,
}


class DeviceMixError(RuntimeError):
    """An op combined tensors on different devices (CUDA would raise here)."""


class DeviceRulesMode(TorchDispatchMode):
    """Raise where CUDA would: an op whose tensors are on different devices. Count the copies that cross
    between the device and the host (``copies``, a ``CopyTally``), and stand in for pinned host memory
    (``pinned``, a ``PinnedMemory``)."""

    def __init__(self):
        super().__init__()
        self.pinned = PinnedMemory()
        self.copies = CopyTally()
        # called as watch(kind, host (start, end) bytes or None, site) for each copy that crosses (StreamLog.copy)
        self.watch: Optional[Callable] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:
            return self.pinned.holds(args[0])
        if func.overloadpacket is aten._pin_memory:
            return self.pinned.add(args[0].clone())
        if func.overloadpacket in _CROSSING:
            crossing = _crossing(func, args, kwargs)
            if crossing is not None:
                kind, where = self._classify(*crossing)
                self.copies.add(kind, where)
                if self.watch is not None:
                    self.watch(kind, _byte_range(crossing[1]), where)
            moved = _host_copy_of_meta(func, args, kwargs)
            if moved is not None:
                return (
                    self.pinned.add(moved) if crossing[3] else moved
                )  # (a non_blocking .to("cpu"))
        else:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors:
                written = _written(func, args, kwargs)
                devices = {
                    t.device for t in tensors if not _host_scalar(t) or any(t is w for w in written)
                }
                if len(devices) > 1:
                    shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
                    raise DeviceMixError(
                        f"{func}: tensors on different devices {sorted(map(str, devices))}: {shapes}"
                    )
        if kwargs.get(
            "pin_memory"
        ):  # no pinned allocator without CUDA: host memory, recorded as pinned
            return self.pinned.add(func(*args, **{**kwargs, "pin_memory": False}))
        return func(*args, **kwargs)

    def _classify(
        self, to_host: bool, host: torch.Tensor, non_blocking: bool, pins_output: bool, direct: bool
    ) -> tuple[str, str]:
        """(kind, where) of one crossing copy; ``host`` is its host side (None: a new host tensor)."""
        pinned = pins_output or (host is not None and self.pinned.holds(host))
        if to_host:
            kind = D2H_ASYNC if pinned and non_blocking and direct else D2H_SYNC
        else:
            kind = (
                H2D_PAGEABLE
                if not (pinned and direct)
                else H2D_ASYNC
                if non_blocking
                else H2D_BLOCKING
            )
        return kind, _caller()


# What a copy between the device and the host costs on CUDA, by the kind the guard counts it as:
D2H_ASYNC = "d2h_async"  # device -> pinned host memory, non_blocking: queued; the host waits on an event later
D2H_SYNC = (
    "d2h_sync"  # device -> host, blocking or into pageable memory: the host waits for the device
)
H2D_ASYNC = "h2d_async"  # pinned host memory -> device, non_blocking: queued, the host goes on
H2D_BLOCKING = "h2d_blocking"  # pinned -> device, blocking: the host waits for the copy (and the stream before it)
H2D_PAGEABLE = (
    "h2d_pageable"  # pageable host memory -> device (or one converted on the way): the host waits
)
SYNC_KINDS = (D2H_SYNC, H2D_BLOCKING, H2D_PAGEABLE)


def _crossing(func, args, kwargs):
    """(to_host, host tensor or None, non_blocking, output pinned, direct) of a copy between the device and
    the host; None for a copy that stays on one side.

    ``direct``: CUDA's copy moves the host memory itself. Otherwise (``copy_kernel_cuda``'s temporaries)
    a copy to the device that converts the dtype or reads a non-contiguous source first makes a
    contiguous converted copy on the host, in pageable memory; one to the host into a non-contiguous
    destination goes through a pageable temporary too (a non_blocking one converts on the device).
    """
    packet = func.overloadpacket
    if packet is aten.copy_:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    elif packet in (aten._copy_from, aten._copy_from_and_resize):
        src, dst = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    elif packet is aten._to_copy:
        src = args[0]
        target = torch.device(kwargs.get("device") or src.device)
        non_blocking = bool(kwargs.get("non_blocking", False))
        if (src.device.type == "cpu") == (target.type == "cpu"):
            return None
        if (
            target.type == "cpu"
        ):  # CUDA pins the result of a non_blocking copy to the host (so it can be async)
            return True, None, non_blocking, bool(kwargs.get("pin_memory") or non_blocking), True
        same = (kwargs.get("dtype") or src.dtype) == src.dtype
        return False, src, non_blocking, False, same and src.is_contiguous()
    else:
        return None
    if (src.device.type == "cpu") == (dst.device.type == "cpu"):
        return None
    to_host = dst.device.type == "cpu"
    if to_host:
        direct = dst.is_contiguous() and (bool(non_blocking) or dst.dtype == src.dtype)
    else:
        direct = (
            src.dtype == dst.dtype
            and src.is_contiguous()
            and dst.is_contiguous()
            and src.shape == dst.shape
        )
    return to_host, dst if to_host else src, bool(non_blocking), False, direct


def _byte_range(t: Optional[torch.Tensor]) -> Optional[tuple[int, int]]:
    return None if t is None else (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def _caller() -> str:
    """file:line of the innermost zengine frame that made the copy (not a torch function mode's pass-through)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if (
            f"{os.sep}zengine{os.sep}" in name
            and f"{os.sep}tests{os.sep}" not in name
            and frame.f_code.co_name != "__torch_function__"
        ):
            return f"{name[name.rindex(os.sep + 'zengine' + os.sep) + 1 :]}:{frame.f_lineno}"
        frame = frame.f_back
    return "<outside zengine>"


class PinnedMemory:
    """Stands in for CUDA's pinned host memory on a CPU-only torch (which refuses ``pin_memory=True``):
    a host tensor allocated with ``pin_memory=True``, by ``.pin_memory()`` or as the result of a
    non_blocking copy to the host is ordinary host memory recorded here, and ``is_pinned()`` answers
    from the record. The tensors are kept alive for the run, so their addresses are never reused by
    pageable memory that would then look pinned."""

    def __init__(self):
        self._kept: list[torch.Tensor] = []
        self._ranges: list[tuple[int, int]] = []  # [start, end) of each pinned storage

    def add(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            storage = t.untyped_storage()
            self._kept.append(t)
            self._ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return t

    def holds(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        at = t.untyped_storage().data_ptr()
        return any(lo <= at < hi for lo, hi in self._ranges)


class CopyTally:
    """Copies between the device and the host, by kind (``D2H_ASYNC`` ...) and by the zengine line that
    made them; ``window()`` returns what was counted since its last call."""

    def __init__(self):
        self.by_kind: Counter = Counter()
        self.by_site: Counter = Counter()  # (kind, file:line)
        self._mark: tuple[Counter, Counter] = (Counter(), Counter())

    def add(self, kind: str, where: str) -> None:
        self.by_kind[kind] += 1
        self.by_site[(kind, where)] += 1

    def window(self) -> tuple[dict, dict]:
        """(copies by kind, copies by (kind, site)) since the last window."""
        kinds, sites = self.by_kind - self._mark[0], self.by_site - self._mark[1]
        self._mark = (self.by_kind.copy(), self.by_site.copy())
        return dict(kinds), dict(sites)


@contextlib.contextmanager
def side_streams_on_meta(streams=None):
    """The stand-in device gets the CUDA paths of ``zengine.offload.copies``: side streams (stand-ins that
    order nothing: meta has no data to order; ``streams``, e.g. a ``StreamLog``, instead of the CPU's) and
    pinned host buffers for what it exchanges with the host (``PinnedMemory``'s, also on a machine with CUDA,
    where ``offload/pinned.py`` would register real ones that the record does not know)."""
    from zengine.accelerator import CpuAccelerator
    from zengine.offload import copies, pinned

    copies.SIDE_STREAMS["meta"] = streams if streams is not None else CpuAccelerator()
    runtime, pinned.RUNTIME = pinned.RUNTIME, False
    try:
        yield
    finally:
        del copies.SIDE_STREAMS["meta"]
        pinned.RUNTIME = runtime


@contextlib.contextmanager
def caching_allocator_on_host():
    """The host taken for a device with a caching allocator where stage 3 decides its optimizer
    groups (cut into the gradient buckets: ``zero/sub_groups.py``) and where the landing drops
    gradient shards between steps (``offload/landing.py``), for engines built inside: their values
    on the host, where CI can check them against torch."""
    import zengine.offload.landing as landing
    import zengine.zero.stage3.build as build

    saved = build.reuses_freed_blocks, landing.kept_between_steps
    build.reuses_freed_blocks = lambda device: True
    landing.kept_between_steps = lambda shard: False
    try:
        yield
    finally:
        build.reuses_freed_blocks, landing.kept_between_steps = saved


def _sites(depth: int = 2) -> str:
    """The innermost ``depth`` zengine frames of the caller, as "file.py:function < file.py:function"."""
    out, frame = [], sys._getframe(2)
    while frame is not None and len(out) < depth:
        name = frame.f_code.co_filename
        if f"{os.sep}zengine{os.sep}" in name and not name.endswith("accelerator.py"):
            out.append(f"{os.path.basename(name)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(out) or "<outside zengine>"


class _LoggedStream:
    """A stream of the stand-in device: what is asked of it goes into its ``StreamLog``."""

    def __init__(self, log: "StreamLog", name: str):
        self.log, self.name = log, name
        self.device = torch.device("meta")
        self.recorded: list = []  # its events, in record order

    def wait_event(self, event) -> None:
        self.log.add("wait", self.name, event.id, _sites())

    def wait_stream(self, other) -> None:
        self.log.add("wait_stream", self.name, other.name, _sites())

    def record_event(self, event=None):
        event = event if event is not None else self.log.Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.log.add("stream_sync", self.name, _sites())
        for event in self.recorded:
            event.landed = True

    def query(self) -> bool:
        return all(e.landed for e in self.recorded)


class _LoggedEvent:
    """An event of the stand-in device. It lands only when the host waits for it or for a later event of its
    stream (``synchronize``): the stand-in device does nothing on its own, so what the host never waited for
    is still in flight, and ``query()`` says so."""

    def __init__(self, log: "StreamLog", *args, **kwargs):
        self.log, self.id = log, next(log.ids)
        self.stream: Optional[_LoggedStream] = None
        self.landed = True  # (never recorded: nothing to wait for)

    def record(self, stream=None) -> None:
        self.stream = stream if stream is not None else self.log.current
        self.stream.recorded.append(self)
        self.landed = False
        self.log.add("record", self.id, self.stream.name, _sites())

    def synchronize(self) -> None:
        self.log.add("sync", self.id, _sites())
        if (
            self.stream is not None
        ):  # a stream runs in order: what it ran before this event has landed too
            for event in self.stream.recorded[: self.stream.recorded.index(self) + 1]:
                event.landed = True

    def query(self) -> bool:
        return self.landed

    def wait(self, stream=None) -> None:
        (stream if stream is not None else self.log.current).wait_event(self)

    def elapsed_time(self, end) -> float:
        return 0.0


class StreamLog:
    """Side streams for the stand-in device (an accelerator's ``Stream``, ``Event``, ``stream``,
    ``current_stream``) that log in ``entries``, in order:

    - ``("record", event, stream, site)``: an event recorded on a stream;
    - ``("wait", stream, event, site)``: a stream waits for an event (on the device: the host goes on);
      ``("wait_stream", stream, other, site)``;
    - ``("sync", event, site)``: the host waits for an event; ``("stream_sync", stream, site)``;
    - ``("copy", kind, stream, (start, end) host bytes or None, site)``: a copy between the device and the host
      issued on a stream (``DeviceRulesMode.watch = log.copy``; kinds as ``CopyTally`` counts them);
    - ``("adam", (start, end) of the gradient, (start, end) of the copy-out target or None)``: each CPU-Adam call
      (``adam_logged``); and whatever the test adds (``add``), e.g. where each forward starts.

    Streams are named "compute" (the current stream outside ``stream(s)``), then "side1", "side2"... in the
    order they are made. Events land only when the host waits for them (``_LoggedEvent``).
    """

    def __init__(self):
        self.entries: list[tuple] = []
        self.ids = itertools.count(1)
        self._names = itertools.count(1)
        self.compute = _LoggedStream(self, "compute")
        self.current = self.compute

    def add(self, *entry) -> None:
        self.entries.append(entry)

    def copy(self, kind: str, host: Optional[tuple[int, int]], site: str) -> None:
        """``DeviceRulesMode.watch``: a copy between the device and the host, on the current stream."""
        self.add("copy", kind, self.current.name, host, site)

    # -- the accelerator's stream API ------------------------------------------------------------
    def Stream(self, *args, **kwargs) -> _LoggedStream:  # noqa: N802 (the accelerator's name)
        return _LoggedStream(self, f"side{next(self._names)}")

    def Event(self, *args, **kwargs) -> _LoggedEvent:  # noqa: N802
        return _LoggedEvent(self, *args, **kwargs)

    @contextlib.contextmanager
    def stream(self, stream):
        saved, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = saved

    def current_stream(self, device_index=None) -> _LoggedStream:
        return self.current

    def default_stream(self, device_index=None) -> _LoggedStream:
        return self.compute

    def synchronize(self, device_index=None) -> None:
        self.add("device_sync", _sites())


@contextlib.contextmanager
def adam_logged(log: StreamLog):
    """Each call of ``adam_step_`` (CPU-Adam over one range, in memory or on swapped moments) goes into
    ``log`` first."""
    import zengine.offload.swapped_adam as swapped
    import zengine.ops.adam as adam

    original = adam.adam_step_

    def logged(param, grad, exp_avg, exp_avg_sq, **kwargs):
        log.add("adam", _byte_range(grad), _byte_range(kwargs.get("copy_out")))
        return original(param, grad, exp_avg, exp_avg_sq, **kwargs)

    adam.adam_step_ = swapped.adam_step_ = logged
    try:
        yield
    finally:
        adam.adam_step_ = swapped.adam_step_ = original


def _host_copy_of_meta(func, args, kwargs):
    """A copy from the stand-in device to the host: meta has no data to give, so the host gets what it
    had (``copy_``) or uninitialised memory (``_to_copy``); host-side work then runs on that."""
    if (
        func.overloadpacket is aten.copy_
        and args[0].device.type == "cpu"
        and args[1].device.type == "meta"
    ):
        torch.broadcast_shapes(args[0].shape, args[1].shape)
        return args[0]
    if (
        func.overloadpacket is aten._to_copy
        and args[0].device.type == "meta"
        and torch.device(kwargs.get("device") or "meta").type == "cpu"
    ):
        return torch.empty(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device="cpu")
    return None


def _host_scalar(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 0


def _written(func, args, kwargs) -> list:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


class _Done:
    def wait(self, *args):
        return True


class FakeCollectives:
    """Stands in for ``torch.distributed`` inside ``zengine.distributed.collectives``; records each call's tensor devices."""

    def __init__(self):
        self.calls: list[tuple[str, frozenset]] = []

    def _record(self, name):
        def collective(*args, **kwargs):
            found = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            self.calls.append((name, frozenset(t.device.type for t in found)))
            return _Done() if kwargs.get("async_op") else None

        return collective

    @contextlib.contextmanager
    def installed(self):
        import zengine.distributed.collectives as zcomm

        stub = types.SimpleNamespace(
            **{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")}
        )
        for name in ("all_reduce", "reduce", "broadcast", "all_gather"):
            setattr(stub, name, self._record(name))
        saved = (zcomm.dist, zcomm._all_gather_flat, zcomm._reduce_scatter_flat)
        zcomm.dist = stub
        zcomm._all_gather_flat = self._record("all_gather_flat")
        zcomm._reduce_scatter_flat = self._record("reduce_scatter_flat")
        try:
            yield self
        finally:
            zcomm.dist, zcomm._all_gather_flat, zcomm._reduce_scatter_flat = saved


class HostReads:
    """Replaces ``zengine.distributed.sync.read_to_host``: counts reads, returns values of a healthy step.

    The values follow ``zero/step_stats.py``: a finite norm, every rank ran a backward, equal
    micro-step fingerprints, gradients reduced, equal (zero) order and gather digests, every
    parameter used on every rank.
    """

    def __init__(self, world: int):
        self.world = world
        self.count = 0

    def __call__(self, t: torch.Tensor) -> list[float]:
        from zengine.zero.step_stats import HEADER, Slot

        self.count += 1
        head = [0.0] * HEADER
        head[Slot.SQ_NORM], head[Slot.HAD_BACKWARD] = 1.0, float(self.world)
        return head + [float(self.world)] * (t.numel() - HEADER)

    @contextlib.contextmanager
    def installed(self):
        import zengine.distributed.sync as zsync

        saved, zsync.read_to_host = zsync.read_to_host, self
        try:
            yield self
        finally:
            zsync.read_to_host = saved


def _fresh_child(fn, args, queue) -> None:
    import sys

    sys.path.insert(
        0, os.path.dirname(os.path.abspath(__file__))
    )  # device_guard and models, for fn
    os.environ["ZENGINE_DEVICE"] = "meta"
    torch.set_num_threads(1)
    queue.put(fn(*args))


def run_on_meta(fn, *args, timeout: float = 240):
    """``fn(*args)`` in a fresh process whose compute device is the stand-in ``meta`` (the guard patches module
    state, so each run gets its own process); ``fn`` must be module-level and return something picklable."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fresh_child, args=(fn, args, queue))
    proc.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        proc.join(timeout=10)
