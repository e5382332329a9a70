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

``StreamCopies`` is for a device with side streams (CUDA), one stream each way (a GPU has a copy
engine each way, so gradients going down and parameters going up move at the same time):

- down: each bucket's piece is copied into pinned host memory on the down stream, after an event
  recorded on the compute stream (so after the bucket's reduction). Neither the host nor the compute
  stream waits for it (``accumulate_async``): the compute stream waits (on the device) only before it
  rewrites the bucket's buffer (``reuse_marker`` / ``before_reuse``), and the host only when the step
  reads that part of the shard (``settle_range``, ``arrivals.py``). ``defers`` tells the readers so.
- up: the step (``step_pipeline.py``) runs CPUAdam piece by piece (NVMe: swap chunk by chunk); each
  piece's parameters, written into pinned staging, go up on the up stream as soon as CPUAdam is done
  with the piece (``writable`` / ``send_piece``), while CPUAdam works on the next; the compute stream
  waits on the last upload's event (on the device) before anything reads the parameters
  (``pieces_sent``). A staging range is rewritten a step later, after the upload that read it (its
  event).

``download`` and ``upload`` are the same two moves for one tensor (ZeRO-Infinity's gradient swap and
parameter write-back); ``before_step`` / ``after_step`` upload whole groups after a step taken whole
(an optimizer that cannot step in pieces; NVMe offload's ``SwappedAdam`` steps its chunks as pieces).

``device_streams`` is the one place that says which devices have side streams and pinned host
memory; the offload code asks it (``host_pinning``) instead of testing for CUDA, so the CPU guard
tests (``tests/device_guard.py``) run the CUDA path on their stand-in device.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from ..device import Accelerator, CudaAccelerator
from . import pinned
from .arrivals import Arrivals


class Landed:
    """A copy that has landed already (it ran in program order): what ``download`` returns off streams."""

    def query(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return True

    def synchronize(self) -> None:
        """Wait until the copy has landed."""


class _Landing(Landed):
    """A copy queued on a side stream: its done event."""

    def __init__(self, done):
        self.done = done

    def query(self) -> bool:
        return self.done.query()

    def synchronize(self) -> None:
        self.done.synchronize()


LANDED = Landed()


class HostCopies:
    """The compute device is the host: add in place, write parameters directly."""

    pins = False  # staging buffers in host memory are pinned (the device copies from them asynchronously)
    defers = False  # downloads land after the calls that queued them: readers settle what they read

    def accumulate(
        self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False
    ) -> None:
        """Add a reduced gradient piece into (a slice of) the fp32 shard; ``overwrite``: the slice holds
        nothing yet since the gradients were zeroed, so the piece is copied in (no zero fill, no add).
        Device work queued after this call may rewrite ``piece``."""
        if overwrite:
            shard_slice.copy_(piece)
        else:
            shard_slice.add_(piece)

    def accumulate_async(
        self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False
    ) -> None:
        """As ``accumulate``, but the device goes on without waiting for ``piece`` to be read: device work may
        rewrite it only after ``before_reuse(m)``, ``m`` a ``reuse_marker()`` taken after this call."""
        self.accumulate(shard_slice, piece, overwrite)

    def settle(self) -> None:
        """Every ``accumulate`` so far has landed in its shard."""

    def settle_range(self, view: torch.Tensor) -> None:
        """Every ``accumulate`` so far into (memory overlapping) host ``view`` has landed in it."""

    def arrival(self, view: torch.Tensor) -> int:
        """Where the newest ``accumulate`` still landing in ``view`` was queued (0: none is): the step
        takes the pieces of the shard in this order."""
        return 0

    def reuse_marker(self):
        """A mark after every download queued so far has read its device source (None: nothing to wait for)."""
        return None

    def before_reuse(self, marker) -> None:
        """Device work queued from now on may rewrite the sources read before ``marker`` (the device waits,
        not the host)."""

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

    def writable(self, gi: int, owned: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Group ``gi``'s copy-out target (as ``copy_out_target``), once elements [lo, hi) of it may be
        rewritten: a step taken piece by piece writes one piece of it, then calls ``send_piece``."""
        return self.copy_out_target(gi, owned)

    def send_piece(self, gi: int, lo: int, hi: int) -> None:
        """The optimizer wrote elements [lo, hi) of group ``gi``'s target: on their way to the device."""

    def pieces_sent(self) -> None:
        """Every piece is sent: device work queued from now on sees the new parameters."""


class BlockingCopies(HostCopies):
    """A compute device other than the host, without side streams: plain copies, in order."""

    def __init__(self):
        self.staging: dict[
            int, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # gi -> (host [owned] compute dtype, device view)

    def accumulate(
        self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False
    ) -> None:
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

    def send_piece(self, gi: int, lo: int, hi: int) -> None:
        if gi in self.staging:
            host, owned = self.staging[gi]
            owned.view(-1)[lo:hi].copy_(host[lo:hi])


class StreamCopies(HostCopies):
    """A compute device with side streams (``streams``, from ``device_streams``): side-stream copies
    through pinned host memory, one stream down and one up (module doc)."""

    pins = True
    defers = True
    UPLOAD_STAGING = (
        2  # pinned buffers ``upload`` cycles through (a reuse waits for the copy that read it)
    )

    def __init__(self, device: torch.device, streams: Accelerator):
        self.device = device
        self.streams = streams
        self.down = streams.Stream(device=device)  # gradients to the host
        self.up = streams.Stream(device=device)  # parameters to the device
        self.arrivals = Arrivals()  # bucket pieces on their way into the host gradient shards
        self._read = None  # event after the newest download has read its device source
        self.staging: dict[
            int, tuple[torch.Tensor, torch.Tensor]
        ] = {}  # gi -> (pinned [owned] compute dtype, device view)
        self.uploaded = None  # the event after the last whole-group upload (after_step)
        self._sent: dict[
            tuple[int, int, int], object
        ] = {}  # (gi, lo, hi) -> event after that piece's upload
        self._last_sent = None  # event after this step's newest piece upload (None: none sent yet)
        self._up: deque = (
            deque()
        )  # (pinned [n] staging, event after the copy that read it) for ``upload``

    def _compute(self):
        return self.streams.current_stream(self.device)

    def _after_compute(self, stream) -> None:
        """``stream`` runs what is queued on it next after everything queued on the compute stream so far:
        an event recorded there, waited for on the device."""
        ready = self.streams.Event()
        ready.record(self._compute())
        stream.wait_event(ready)

    # -- down --------------------------------------------------------------------------------------
    def accumulate(
        self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False
    ) -> None:
        self.accumulate_async(shard_slice, piece, overwrite)
        if piece.device.type != "cpu" and shard_slice.device.type == "cpu":
            self.before_reuse(
                self._read
            )  # the caller may rewrite the piece now (the device waits, not the host)

    def accumulate_async(
        self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False
    ) -> None:
        if (
            piece.device.type == "cpu" or shard_slice.device.type != "cpu"
        ):  # nothing crosses to the host
            HostCopies.accumulate(self, shard_slice, piece, overwrite)
            return
        # The copy lands in the pinned shard itself when the piece is the first since the gradients were
        # zeroed (nothing for the host to do then), else in pinned staging that the host adds in later.
        direct = overwrite and shard_slice.is_pinned()
        # A bucket piece's staging lives until the host added it: torch's caching allocator hands the same
        # blocks back step after step, which a registration per piece (pinned.py) could not do cheaply.
        staging = (
            None if direct else torch.empty(piece.shape, dtype=shard_slice.dtype, pin_memory=True)
        )  # [n] fp32
        landing = self._queue_down(shard_slice if direct else staging, piece)
        self.arrivals.add(landing, staging, shard_slice, overwrite)
        self.arrivals.poll()  # adds the pieces that landed meanwhile (never waits)

    def _queue_down(self, dst: torch.Tensor, src: torch.Tensor) -> _Landing:
        """Queue ``src`` (device) -> pinned ``dst`` on the down stream, after what the compute stream queued so
        far (the bucket's reduction); sets ``_read``. Nothing waits for it here."""
        self._after_compute(self.down)
        with self.streams.stream(self.down):
            # Converted to the destination's dtype (fp32) on the device: a copy that converts on the way to
            # the host goes through a pageable host temporary (torch's copy_), and the host would then add
            # mixed dtypes (several times slower than like to like). The converted temporary is the down
            # stream's own memory (allocated there), so it may be freed as soon as the copy is queued.
            source = src if src.dtype == dst.dtype else src.to(dst.dtype)
            read = None
            if source is not src:  # the bucket is free again once converted, before its copy lands
                read = self.streams.Event()
                read.record(self.down)
            dst.copy_(source, non_blocking=True)
            done = self.streams.Event()
            done.record(self.down)
        if src.device.type == "cuda":
            # Its memory must not go to other work before the down stream has read it, if it is freed (a
            # reduce-scatter's output, an adopted gradient): the caching allocator waits for that.
            src.record_stream(self.down)
        self._read = read if read is not None else done
        return _Landing(done)

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Landed:
        if src.device.type == "cpu" or not dst.is_pinned():  # (pageable memory: a blocking copy)
            return super().download(dst, src)
        landing = self._queue_down(dst, src)
        # The caller may rewrite the source by later device work: the compute stream must not before the
        # down stream has read it. A device-side wait; the host goes on.
        self._compute().wait_event(self._read)
        return landing

    def reuse_marker(self):
        return self._read

    def before_reuse(self, marker) -> None:
        if marker is not None:
            self._compute().wait_event(marker)  # on the device: the host goes on

    def settle(self) -> None:
        self.arrivals.settle()

    def settle_range(self, view: torch.Tensor) -> None:
        self.arrivals.settle_range(view)

    def arrival(self, view: torch.Tensor) -> int:
        return self.arrivals.arrival(view)

    # -- up ----------------------------------------------------------------------------------------
    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type == "cpu" or src.device.type != "cpu":
            super().upload(dst, src)
            return
        # Through pinned staging in dst's dtype, converted here on the host: a copy from pageable memory,
        # or one that converts on the way to the device (torch converts on the host, into a pageable
        # temporary), would make the host wait for it.
        staging = self._upload_staging(dst.numel(), dst.dtype)
        staging.copy_(src.reshape(-1))
        self._after_compute(self.up)  # nothing queued before still reads dst's old values
        with self.streams.stream(self.up):
            dst.view(-1).copy_(staging, non_blocking=True)
            done = self.streams.Event()
            done.record(self.up)
        self._compute().wait_event(done)  # what the device does next sees the new values
        self._up.append((staging, done))

    def _upload_staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned [numel] ``dtype`` buffer no copy still reads: the oldest of ``UPLOAD_STAGING``, reused."""
        if len(self._up) >= self.UPLOAD_STAGING:
            buf, done = self._up.popleft()
            done.synchronize()  # waits only when the device is that many uploads behind
            if buf.dtype == dtype and buf.numel() >= numel:
                return buf[:numel]
        return pinned.empty(numel, dtype, kind=pinned.STAGING)

    def copy_out_target(self, gi: int, owned: torch.Tensor) -> torch.Tensor:
        if owned.device.type == "cpu":
            return owned
        if gi not in self.staging:  # a group's parameter shard never moves: one staging buffer each
            self.staging[gi] = (
                pinned.empty(owned.numel(), owned.dtype, kind=pinned.STAGING),
                owned,
            )
        return self.staging[gi][0]

    def before_step(self) -> None:
        # CPUAdam is about to overwrite the staging the last uploads read (a step ago: long done)
        for done in [self.uploaded, *self._sent.values()]:
            if done is not None:
                done.synchronize()
        self.uploaded, self._sent = None, {}

    def after_step(self) -> None:
        if not self.staging:
            return
        self._after_compute(self.up)  # nothing on the device still reads the old parameters
        with self.streams.stream(self.up):
            for host, owned in self.staging.values():
                owned.view(-1).copy_(host, non_blocking=True)
            self.uploaded = self.streams.Event()
            self.uploaded.record(self.up)
        self._compute().wait_event(
            self.uploaded
        )  # the all-gather and the next forward see the new values

    def writable(self, gi: int, owned: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        target = self.copy_out_target(gi, owned)
        if self.uploaded is not None:  # a whole-group upload (after_step) still reads every range
            self.uploaded.synchronize()
            self.uploaded = None
        done = self._sent.pop((gi, lo, hi), None)
        if done is not None:
            # CPUAdam is about to rewrite the staging this piece's last upload read, a step ago: long landed
            # (the step's read of its control values waited for the compute stream, which waited for it).
            done.synchronize()
        return target

    def send_piece(self, gi: int, lo: int, hi: int) -> None:
        if (
            gi not in self.staging
        ):  # the target is the host shard itself (offload_param): nothing goes up
            return
        host, owned = self.staging[gi]
        if (
            self._last_sent is None
        ):  # the step's first piece: nothing queued before still reads the parameters
            self._after_compute(self.up)
        with self.streams.stream(self.up):
            owned.view(-1)[lo:hi].copy_(host[lo:hi], non_blocking=True)
            done = self.streams.Event()
            done.record(self.up)
        self._sent[(gi, lo, hi)] = self._last_sent = done

    def pieces_sent(self) -> None:
        if self._last_sent is not None:
            # The up stream runs the pieces in order: its newest event covers them all. The all-gather and the
            # next forward, queued after this, see the new values; the host goes on.
            self._compute().wait_event(self._last_sent)
            self._last_sent = None


# device type -> its side-stream API: an accelerator of ``zengine.device`` (``Stream``, ``Event``,
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
