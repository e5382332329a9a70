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
  fake backend takes ``cuda`` and ``meta``, as NCCL takes ``cuda``).

torch's ``FakeTensorMode`` would fake ``cuda`` tensors directly, but on a
CPU-only build its ``copy_`` and ``.data =`` on fake CUDA tensors fail in
C++ (no CUDA device guard), and the engine needs both.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
# Ops that move data between devices by design.
_CROSSING = {aten.copy_, aten._to_copy, aten._copy_from, aten._copy_from_and_resize, aten.lift_fresh_copy}


class DeviceMixError(RuntimeError):
    """An op combined tensors on different devices (CUDA would raise here)."""


class DeviceRulesMode(TorchDispatchMode):
    """Raise where CUDA would: an op whose tensors are on different devices."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _CROSSING:
            moved = _host_copy_of_meta(func, args, kwargs)
            if moved is not None:
                return moved
        else:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors:
                written = _written(func, args, kwargs)
                devices = {t.device for t in tensors if not _host_scalar(t) or any(t is w for w in written)}
                if len(devices) > 1:
                    shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
                    raise DeviceMixError(f"{func}: tensors on different devices {sorted(map(str, devices))}: {shapes}")
        return func(*args, **kwargs)


def _host_copy_of_meta(func, args, kwargs):
    """A copy from the stand-in device to the host: meta has no data to give, so the host gets what it
    had (``copy_``) or uninitialised memory (``_to_copy``); host-side work then runs on that."""
    if func.overloadpacket is aten.copy_ and args[0].device.type == "cpu" and args[1].device.type == "meta":
        torch.broadcast_shapes(args[0].shape, args[1].shape)
        return args[0]
    if func.overloadpacket is aten._to_copy and args[0].device.type == "meta" and \
            torch.device(kwargs.get("device") or "meta").type == "cpu":
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

        stub = types.SimpleNamespace(**{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
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
        from zengine.zero.step_stats import _HEADER

        self.count += 1
        return [1.0, float(self.world)] + [0.0] * (_HEADER - 2) + [float(self.world)] * (t.numel() - _HEADER)

    @contextlib.contextmanager
    def installed(self):
        import zengine.distributed.sync as zsync

        saved, zsync.read_to_host = zsync.read_to_host, self
        try:
            yield self
        finally:
            zsync.read_to_host = saved
