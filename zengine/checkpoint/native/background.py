"""Asynchronous checkpoints: ``save_checkpoint(..., async_save=True)`` (or the config's
``checkpoint.writer.decoupled``) copies what each rank writes to host memory and returns; a thread per rank
writes its file, and rank 0's thread publishes the checkpoint once every rank's file is written.

    step k:   agree on the tag, make the staging folder, snapshot to host memory   (the step waits for this)
    thread:   write + fsync this rank's file, post its size and checksum to the store
    rank 0:   after every rank posted: state.pt, meta.json, rename into place, 'latest'  (save.py's _finish)
    later:    the next save / load_checkpoint / engine.wait_for_checkpoint() / destroy waits and raises
              CheckpointSaveError on every rank if any rank failed

The ranks meet through the process group's key-value store, not a collective: the training collectives
keep running on the group meanwhile. The protocol stays atomic (save.py): until rank 0 renames the staging
folder the previous checkpoint and 'latest' are untouched, so a kill -9 during the background write loses
only the checkpoint being written. The snapshot costs host memory equal to this rank's share of the
checkpoint while it is written (as torch's ``async_save``); on a GPU it is pinned and copied without
blocking, ordered by an event the thread waits on. The pinned buffer, sized exactly, is kept for the next
save (pinned once: ``_SnapshotBuffer``) until ``engine.destroy()``.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from ...distributed import diagnose
from ...offload import pinned
from . import atomic
from ..errors import CheckpointSaveError

_PREFIX = "zengine/async_ckpt/"
_pending: "weakref.WeakKeyDictionary[Any, BackgroundSave]" = weakref.WeakKeyDictionary()


def host_snapshot(
    entries: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """Copies of ``entries`` in host memory, and an event to wait on before reading them (None on the CPU).
    Those of device tensors are views into one pinned buffer (``_SnapshotBuffer``)."""
    out, event = [], None
    views = iter(_SnapshotBuffer.views([t for _, t in entries if t.device.type != "cpu"]))
    for key, t in entries:
        t = t.detach()
        if t.device.type == "cpu":
            out.append((key, t.clone()))
        else:  # pinned, so that the copy need not block the step; the thread waits on the event
            host = next(views)
            host.copy_(t, non_blocking=True)
            out.append((key, host))
            event = torch.Event(device=t.device)
    if event is not None:
        event.record()
    return out, event


class _SnapshotBuffer:
    """The pinned host memory of asynchronous snapshots: one buffer, sized exactly to a save and kept for
    the next (saves of one run are the same size), so it is pinned once, not per save (registering takes
    about a second per few GiB, on the step's time; ``offload/pinned.py``). A save's views hold a lease;
    when the last of them is gone (the writer dropped the snapshot) the buffer is free for the next save.
    ``release()`` drops a free one (engine.destroy)."""

    ALIGN = 64  # bytes each view starts on (any dtype's alignment)
    _lock = threading.Lock()
    _idle: Optional[torch.Tensor] = None  # [bytes] uint8, pinned, lent to no snapshot

    @classmethod
    def views(cls, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped as ``tensors``, views into the buffer, leased until they are all gone."""
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN
        if not tensors:
            return []
        with cls._lock:
            buf, cls._idle = cls._idle, None
        if buf is None or buf.numel() != total:  # the first save, or another model's: pinned anew
            del buf  # (the old one is unpinned and freed before the new one is allocated)
            buf = pinned.empty(total, torch.uint8, kind=pinned.SNAPSHOT)
        lease = _Lease()
        weakref.finalize(lease, cls._give_back, buf).atexit = False
        out = []
        for t, at in zip(tensors, offsets):
            view = buf[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view._zengine_snapshot_lease = (
                lease  # (a tensor's attribute lives as long as the tensor)
            )
            out.append(view)
        return out

    @classmethod
    def _give_back(cls, buf: torch.Tensor) -> None:
        with cls._lock:
            cls._idle = buf

    @classmethod
    def release(cls) -> None:
        """Unpin the free buffer, if any (one lent to a save in flight goes when that save is written)."""
        with cls._lock:
            cls._idle = None


class _Lease:
    """Held by a snapshot's views; its finalizer gives the buffer back."""


def release_snapshot_memory() -> None:
    """Drop the pinned snapshot buffer kept for the next asynchronous save (no save in flight needs it)."""
    _SnapshotBuffer.release()


class _LocalStore:
    """The store's two calls, for one process (world size 1, or no store)."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]


class BackgroundSave:
    """One asynchronous save in flight on this rank (see the module doc)."""

    def __init__(
        self,
        name: str,
        rank: int,
        ranks: list[int],
        staging: str,
        save_dir: str,
        tag: str,
        write: Callable[[], dict],
        finish: Optional[Callable[[list[dict]], None]],
    ):
        store = diagnose.default_store() if len(ranks) > 1 else None
        self.store = store if store is not None else _LocalStore()
        self.base = _PREFIX + name
        self.rank, self.ranks, self.staging, self.save_dir, self.tag = (
            rank,
            ranks,
            staging,
            save_dir,
            tag,
        )
        self._write, self._finish = write, finish  # finish: rank 0 only
        self.thread = threading.Thread(
            target=self._run, name=f"zengine-checkpoint-{tag}", daemon=True
        )
        self.error: Optional[str] = None

    def start(self) -> "BackgroundSave":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            posted = self._write()
        except BaseException as e:  # reported on every rank at the wait
            posted = {
                "error": f"rank {self.rank} writing its file in {self.staging}: {type(e).__name__}: {e}"
            }
        self._write = None  # drop the snapshot now (the host memory it holds)
        self.store.set(f"{self.base}/{self.rank}", json.dumps(posted))
        if self._finish is None:
            return
        errors = []
        try:
            everyone = [
                json.loads(self.store.get(f"{self.base}/{r}")) for r in self.ranks
            ]  # (blocks until set)
            errors = [p["error"] for p in everyone if "error" in p]
            if not errors:
                self._finish(everyone)
        except BaseException as e:
            errors.append(f"rank 0 publishing: {type(e).__name__}: {e}")
        if errors:
            atomic.discard(self.staging)
        self.store.set(f"{self.base}/result", json.dumps(errors))

    def wait(self) -> None:
        """Until this save is published (or failed): raise CheckpointSaveError on every rank if it failed."""
        self.thread.join()
        errors = json.loads(self.store.get(f"{self.base}/result"))
        if errors:
            raise CheckpointSaveError(
                f"save_checkpoint(async_save=True): could not write checkpoint {self.tag!r} in {self.save_dir}; "
                "the previous checkpoint and 'latest' are untouched:\n  " + "\n  ".join(errors)
            )


def track(engine, save: BackgroundSave) -> None:
    _pending[engine] = save


def wait(engine) -> None:
    """Finish ``engine``'s asynchronous save in flight, if any (every rank calls it: the save, load, wait and
    destroy calls do)."""
    save = _pending.pop(engine, None)
    if save is not None:
        save.wait()


def in_flight(engine) -> bool:
    """True while an asynchronous save of ``engine`` has not been waited for."""
    return engine in _pending
