"""Device memory on the stand-in device: live and peak bytes of ``meta`` storages, by the line that made them.

``torch.cuda.max_memory_allocated`` is what a GPU run reports; CI has no GPU, so this counts the same
thing on ``meta`` (``device_guard.py``'s stand-in): every storage a dispatched op creates on the device
is recorded with the innermost zengine line that made it (or the test's, outside zengine) and counted
while it lives. Sizes are read from the storages themselves, so a storage stage 3 frees by resizing it
to zero (``untyped_storage().resize_(0)``) and grows again at the next gather counts as it is. At each
new peak the live bytes are kept by site, so ``peak_sites()`` says what made up the worst moment.

    with DeviceMemory() as memory:   # inside device_guard's other stand-ins
        ... train ...
    memory.peak, memory.live(), memory.peak_sites()
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


# torch's own code whose storages are named by their line: a peer's (FSDP2's) sharding and
# collectives, and the optimizers' states
TORCH_SITES = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}optim{os.sep}")


def _site() -> str:
    """file:line of the innermost zengine frame making the storage (or of torch's distributed or
    optim code, ``torch/...``), else of the innermost test frame."""
    frame, fallback = sys._getframe(3), None
    while frame is not None:
        name = frame.f_code.co_filename
        torch_site = next((t for t in TORCH_SITES if t in name), None)
        if torch_site is not None:
            return (
                f"torch/{name[name.rindex(torch_site) + len('torch' + os.sep) :]}:{frame.f_lineno}"
            )
        if (
            f"{os.sep}zengine{os.sep}" in name
            and f"{os.sep}tests{os.sep}" not in name
            and frame.f_code.co_name != "__torch_function__"  # a mode's pass-through
        ):
            return f"{name[name.rindex(os.sep + 'zengine' + os.sep) + 1 :]}:{frame.f_lineno}"
        if fallback is None and f"{os.sep}tests{os.sep}" in name and "device_" not in name:
            fallback = f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "<torch>"


def _plain_tensors(leaves):
    """The plain tensors among ``leaves``, a tensor subclass (FSDP2's ``DTensor``) replaced by the
    tensors it wraps: a wrapper's own storage holds no bytes of its own and is not the same object
    twice, so counting it would count the whole (unsharded) size again at each call."""
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            yield t
        elif hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            yield from _plain_tensors(getattr(t, n) for n in names)
        else:
            yield t


class DeviceMemory(TorchDispatchMode):
    """Counts the bytes of live storages on ``device`` (the stand-in ``meta``) and their peak.

    ``phase(name)`` starts a named phase: ``peaks`` then holds each phase's own peak (as resetting
    ``torch.cuda.reset_peak_memory_stats`` between phases would). ``mark_kept()`` marks what is
    live now (after a step: the model states a run keeps from step to step); ``peak_kept`` is how
    much of the peak those storages were, whoever made them."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = device
        self._live: dict[int, tuple[weakref.ref, str]] = {}
        self.peak = 0
        self._peak_sites: Counter = Counter()
        self.peaks: dict[str, int] = {}
        self._phase: Optional[str] = None
        self._counts = True  # the current phase counts toward ``peak``
        self._kept: dict[int, weakref.ref] = {}  # mark_kept(): key -> the storage's reference
        self.peak_kept = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = False
        for t in _plain_tensors(tree_leaves(out)):
            if t.device.type == self.device:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._live:
                    self._live[key] = (weakref.ref(storage), _site())
                    weakref.finalize(storage, self._live.pop, key, None)
                    fresh = True
        if fresh or func is torch.ops.aten.copy_.default:  # (a regrown stage-3 buffer is written)
            self._note()
        return out

    def live(self) -> int:
        """Bytes of the device storages alive now."""
        return sum(s.nbytes() for s in self._storages())

    def _storages(self):
        for ref, _ in list(self._live.values()):
            storage = ref()
            if storage is not None:
                yield storage

    def _note(self) -> None:
        now = self.live()
        if self._phase is not None and now > self.peaks.get(self._phase, 0):
            self.peaks[self._phase] = now
        if now > self.peak and self._counts:
            self.peak = now
            self._peak_sites = self.by_site()
            self.peak_kept = self._kept_bytes()

    def mark_kept(self) -> None:
        """The storages live now are the ones kept from step to step (``peak_kept``)."""
        self._kept = {key: ref for key, (ref, _) in self._live.items()}

    def _kept_bytes(self) -> int:
        total = 0
        for key, ref in self._kept.items():
            entry = self._live.get(key)
            storage = ref()
            if entry is not None and entry[0] is ref and storage is not None:
                total += storage.nbytes()
        return total

    def by_site(self) -> Counter:
        """Live bytes now, by the line that made each storage."""
        sites: Counter = Counter()
        for ref, site in list(self._live.values()):
            storage = ref()
            if storage is not None and storage.nbytes():
                sites[site] += storage.nbytes()
        return sites

    def peak_sites(self) -> dict[str, int]:
        """Live bytes at the peak, by the line that made each storage, largest first."""
        return dict(self._peak_sites.most_common())

    def phase(self, name: str, counts: bool = True) -> None:
        """Start phase ``name``: its peak counts from the bytes live now. A phase that does not
        ``count`` keeps its own peak out of ``peak`` (a step on the stand-in runs torch's foreach
        Adam, whose temporaries a GPU's fused Adam does not make)."""
        self._phase, self._counts = name, counts
        self.peaks[name] = max(self.peaks.get(name, 0), self.live())
