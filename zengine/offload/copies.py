"""Copies between the compute device and the host memory that holds offloaded shards.

With ``offload_optimizer.device = "cpu"`` two streams of data cross between
the device and the host every step:

- down: each reduced gradient bucket's piece of this rank's shard, added
  into the fp32 gradient shard in host memory (during backward);
- up: the updated parameters in the compute dtype, written by CPUAdam in the
  same pass as the step, copied into the device's parameter shard.

``HostCopies`` is for a compute device that *is* the host (this CPU-only
machine): the pieces are added in place and CPUAdam writes the parameters
directly, so nothing is copied at all.

``BlockingCopies`` is for any other device (an accelerator without CUDA
streams): plain copies through host staging, in order.

``StreamCopies`` is for a device with side streams (CUDA). Downloads run on
a side stream into pinned staging buffers, so backward keeps computing while
they travel; the host adds a piece into the shard once its copy is done
(polled as later buckets arrive, all of them by ``settle()`` at the end of
backward). Uploads run on a side stream from pinned staging that CPUAdam
wrote; the compute stream waits for them on the device (not the host) before
anything reads the parameters, and the host waits for the previous upload
before CPUAdam writes the staging again. ``download`` and ``upload`` are the
same two moves for one tensor (stages 0-1's gradient shard, ZeRO-Infinity's
gradient swap and parameter write-back).

``device_streams`` is the one place that says which devices have side streams and pinned host
memory; the offload code asks it (``host_pinning``) instead of testing for CUDA, so the CPU guard
tests (``tests/device_guard.py``) run the CUDA path on their stand-in device.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from ..accelerator import Accelerator, CudaAccelerator
from . import pinned


class Landed:
    """A copy that has landed already (it ran in program order): what ``download`` returns off streams."""

    def query(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return True

    def synchronize(self) -> None:
        """Wait until the copy has landed."""


class _Landing(Landed):
    """A copy queued on a side stream: its done event, and the device source it reads (kept alive until then)."""

    def __init__(self, done, source: torch.Tensor):
        self.done, self.source = done, source

    def query(self) -> bool:
        return self.done.query()

    def synchronize(self) -> None:
        self.done.synchronize()
        self.source = None


LANDED = Landed()


class HostCopies:
    """The compute device is the host: add in place, write parameters directly."""

    pins = False  # staging buffers in host memory are pinned (the device copies from them asynchronously)

    def accumulate(self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False) -> None:
        """Add a reduced gradient piece into (a slice of) the fp32 shard; ``overwrite``: the slice holds
        nothing yet since the gradients were zeroed, so the piece is copied in (no zero fill, no add)."""
        if overwrite:
            shard_slice.copy_(piece)
        else:
            shard_slice.add_(piece)

    def settle(self) -> None:
        """Every ``accumulate`` so far has landed in its shard."""

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Landed:
        """Copy ``src`` (any device) into host ``dst`` (converted to its dtype); the host reads ``dst`` after
        the returned landing's ``synchronize()`` (or once its ``query()`` is true). ``src`` may be rewritten
        by later device work as soon as this returns."""
        dst.copy_(src)
        return LANDED

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host ``src`` into ``dst`` (the compute device's memory, any dtype); ``src`` may be rewritten
        as soon as this returns, and device work queued after it sees the new values."""
        dst.copy_(src)

    def copy_out_target(self, gi: int, owned: torch.Tensor) -> torch.Tensor:
        """Where the optimizer writes group ``gi``'s updated compute-dtype parameters."""
        return owned

    def before_step(self) -> None:
        """Called before the optimizer writes the copy-out targets."""

    def after_step(self) -> None:
        """Called after it wrote them: make the device parameters current."""


class BlockingCopies(HostCopies):
    """A compute device other than the host, without side streams: plain copies, in order."""

    def __init__(self):
        self.staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # gi -> (host [owned] compute dtype, device view)

    def accumulate(self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False) -> None:
        if overwrite:
            shard_slice.copy_(piece)
        else:
            shard_slice.add_(piece.to(shard_slice.device))

    def copy_out_target(self, gi: int, owned: torch.Tensor) -> torch.Tensor:
        if owned.device.type == "cpu":
            return owned
        if gi not in self.staging:
            self.staging[gi] = (torch.empty(owned.numel(), dtype=owned.dtype, device="cpu"), owned)
        return self.staging[gi][0]

    def after_step(self) -> None:
        for host, owned in self.staging.values():
            owned.view(-1).copy_(host)


class StreamCopies(HostCopies):
    """A compute device with side streams (``streams``, from ``device_streams``): side-stream copies
    through pinned host staging."""

    pins = True
    UPLOAD_STAGING = 2  # pinned buffers ``upload`` cycles through (a reuse waits for the copy that read it)

    def __init__(self, device: torch.device, streams: Accelerator):
        self.device = device
        self.streams = streams
        self.side = streams.Stream(device=device)
        # (landing, pinned [n] fp32 staging or None, fp32 [n] shard slice, overwrite) in launch order
        self.pending: deque = deque()
        self.staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # gi -> (pinned [owned] compute dtype, device view)
        self.uploaded = None  # the event after the last upload
        self._up: deque = deque()  # (pinned [n] staging, event after the copy that read it) for ``upload``

    def accumulate(self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False) -> None:
        if piece.device.type == "cpu" or shard_slice.device.type != "cpu":  # nothing crosses to the host
            super().accumulate(shard_slice, piece, overwrite)
            return
        # The copy lands in the pinned shard itself when the piece is the first since the gradients were
        # zeroed (nothing for the host to do then), else in pinned staging that the host adds in later.
        direct = overwrite and shard_slice.is_pinned()
        # A bucket piece's staging lives until the host added it: torch's caching allocator hands the same
        # blocks back step after step, which a registration per piece (pinned.py) could not do cheaply.
        staging = None if direct else torch.empty(piece.shape, dtype=shard_slice.dtype, pin_memory=True)  # [n] fp32
        landing = self.download(shard_slice if direct else staging, piece)
        self.pending.append((landing, staging, shard_slice, overwrite))
        self._drain(block=False)

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Landed:
        if src.device.type == "cpu" or not dst.is_pinned():  # (pageable memory: a blocking copy)
            return super().download(dst, src)
        compute = self.streams.current_stream(self.device)
        self.side.wait_stream(compute)  # the source is final on the compute stream
        with self.streams.stream(self.side):
            # Converted to the destination's dtype (fp32) on the device: a copy that converts on the way to
            # the host goes through a pageable host temporary (torch's copy_), and the host would then add
            # mixed dtypes (several times slower than like to like).
            source = src if src.dtype == dst.dtype else src.to(dst.dtype)
            dst.copy_(source, non_blocking=True)
            done = self.streams.Event()
            done.record(self.side)
        # The source (a bucket buffer) is reused by later device work: the compute stream must not write it
        # before the copy has read it. This is a device-side wait; the host goes on.
        compute.wait_event(done)
        return _Landing(done, source)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type == "cpu" or src.device.type != "cpu":
            super().upload(dst, src)
            return
        # Through pinned staging in dst's dtype, converted here on the host: a copy from pageable memory,
        # or one that converts on the way to the device (torch converts on the host, into a pageable
        # temporary), would make the host wait for it.
        staging = self._upload_staging(dst.numel(), dst.dtype)
        staging.copy_(src.reshape(-1))
        compute = self.streams.current_stream(self.device)
        self.side.wait_stream(compute)  # nothing queued before still reads dst's old values
        with self.streams.stream(self.side):
            dst.view(-1).copy_(staging, non_blocking=True)
            done = self.streams.Event()
            done.record(self.side)
        compute.wait_event(done)  # what the device does next sees the new values
        self._up.append((staging, done))

    def _upload_staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned [numel] ``dtype`` buffer no copy still reads: the oldest of ``UPLOAD_STAGING``, reused."""
        if len(self._up) >= self.UPLOAD_STAGING:
            buf, done = self._up.popleft()
            done.synchronize()  # waits only when the device is that many uploads behind
            if buf.dtype == dtype and buf.numel() >= numel:
                return buf[:numel]
        return pinned.empty(numel, dtype, kind=pinned.STAGING)

    def _drain(self, block: bool) -> None:
        while self.pending and (block or self.pending[0][0].query()):
            landing, staging, shard_slice, overwrite = self.pending.popleft()
            landing.synchronize()
            if staging is not None:
                shard_slice.copy_(staging) if overwrite else shard_slice.add_(staging)

    def settle(self) -> None:
        self._drain(block=True)

    def copy_out_target(self, gi: int, owned: torch.Tensor) -> torch.Tensor:
        if owned.device.type == "cpu":
            return owned
        if gi not in self.staging:  # a group's parameter shard never moves: one staging buffer each
            self.staging[gi] = (pinned.empty(owned.numel(), owned.dtype, kind=pinned.STAGING), owned)
        return self.staging[gi][0]

    def before_step(self) -> None:
        if self.uploaded is not None:  # CPUAdam is about to overwrite the staging the last upload read
            self.uploaded.synchronize()
            self.uploaded = None

    def after_step(self) -> None:
        if not self.staging:
            return
        compute = self.streams.current_stream(self.device)
        self.side.wait_stream(compute)  # nothing on the device still reads the old parameters
        with self.streams.stream(self.side):
            for pinned, owned in self.staging.values():
                owned.view(-1).copy_(pinned, non_blocking=True)
            self.uploaded = self.streams.Event()
            self.uploaded.record(self.side)
        compute.wait_event(self.uploaded)  # the all-gather and the next forward see the new values


# device type -> its side-stream API: an accelerator of ``zengine.accelerator`` (``Stream``, ``Event``,
# ``stream``, ``current_stream``). The CPU guard tests add their stand-in device here.
SIDE_STREAMS: dict[str, Accelerator] = {"cuda": CudaAccelerator()}


def device_streams(device: torch.device) -> Optional[Accelerator]:
    """The side-stream API of ``device`` when copies between it and pinned host memory can run on a side
    stream, ordered by events (CUDA); None for the host itself and for devices without streams."""
    return SIDE_STREAMS.get(device.type)


def host_pinning(device: torch.device) -> bool:
    """Whether host buffers that exchange data with ``device`` are pinned (where the config asks for
    ``pin_memory``; staging buffers always): only a device with side streams copies from pinned memory
    without the host waiting."""
    return device_streams(device) is not None


def make_copies(device: torch.device) -> HostCopies:
    """The copy strategy between ``device`` and host memory."""
    streams = device_streams(device)
    if streams is not None:
        return StreamCopies(device, streams)
    if device.type == "cpu":
        return HostCopies()
    return BlockingCopies()
