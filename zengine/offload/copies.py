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

``StreamCopies`` is for a CUDA device. Downloads run on a side stream into
pinned staging buffers, so backward keeps computing while they travel; the
host adds a piece into the shard once its copy is done (polled as later
buckets arrive, all of them by ``settle()`` at the end of backward). Uploads
run on a side stream from pinned staging that CPUAdam wrote; the compute
stream waits for them on the device (not the host) before anything reads the
parameters, and the host waits for the previous upload before CPUAdam writes
the staging again.
"""
from __future__ import annotations

from collections import deque

import torch


class HostCopies:
    """The compute device is the host: add in place, write parameters directly."""

    def accumulate(self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False) -> None:
        """Add a reduced gradient piece into (a slice of) the fp32 shard; ``overwrite``: the slice holds
        nothing yet since the gradients were zeroed, so the piece is copied in (no zero fill, no add)."""
        if overwrite:
            shard_slice.copy_(piece)
        else:
            shard_slice.add_(piece)

    def settle(self) -> None:
        """Every ``accumulate`` so far has landed in its shard."""

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
    """A CUDA compute device: side-stream copies through pinned host staging."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device=device)
        # (done event, pinned [n] staging, fp32 [n] shard slice) in launch order
        self.pending: deque = deque()
        self.staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # gi -> (pinned [owned] compute dtype, device view)
        self.uploaded: torch.cuda.Event | None = None

    def accumulate(self, shard_slice: torch.Tensor, piece: torch.Tensor, overwrite: bool = False) -> None:
        if piece.device.type != "cuda" or shard_slice.device.type == "cuda":
            super().accumulate(shard_slice, piece, overwrite)
            return
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)  # the piece is final on the compute stream
        with torch.cuda.stream(self.side):
            # Converted to the shard's dtype (fp32) on the device: the host then adds like to like
            # (a mixed-dtype add on the host is several times slower), or does nothing at all when the
            # copy lands in the pinned shard itself (the first piece since the gradients were zeroed).
            source = piece if piece.dtype == shard_slice.dtype else piece.to(shard_slice.dtype)
            if overwrite and shard_slice.is_pinned():
                staging = None
                shard_slice.copy_(source, non_blocking=True)
            else:
                staging = torch.empty(piece.shape, dtype=shard_slice.dtype, pin_memory=True)  # [n] fp32, host
                staging.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        # The bucket buffer is reused by later buckets: the compute stream must not write it before
        # the copy has read it. This is a device-side wait; the host goes on with backward.
        compute.wait_event(done)
        self.pending.append((done, staging, shard_slice, overwrite, source))
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        while self.pending and (block or self.pending[0][0].query()):
            done, staging, shard_slice, overwrite, _ = self.pending.popleft()  # (the source lives until here)
            done.synchronize()
            if staging is not None:
                shard_slice.copy_(staging) if overwrite else shard_slice.add_(staging)

    def settle(self) -> None:
        self._drain(block=True)

    def copy_out_target(self, gi: int, owned: torch.Tensor) -> torch.Tensor:
        if owned.device.type != "cuda":
            return owned
        if gi not in self.staging:  # a group's parameter shard never moves: one staging buffer each
            self.staging[gi] = (torch.empty(owned.numel(), dtype=owned.dtype, pin_memory=True), owned)
        return self.staging[gi][0]

    def before_step(self) -> None:
        if self.uploaded is not None:  # CPUAdam is about to overwrite the staging the last upload read
            self.uploaded.synchronize()
            self.uploaded = None

    def after_step(self) -> None:
        if not self.staging:
            return
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)  # nothing on the device still reads the old parameters
        with torch.cuda.stream(self.side):
            for pinned, owned in self.staging.values():
                owned.view(-1).copy_(pinned, non_blocking=True)
            self.uploaded = torch.cuda.Event()
            self.uploaded.record(self.side)
        compute.wait_event(self.uploaded)  # the all-gather and the next forward see the new values


def make_copies(device: torch.device) -> HostCopies:
    """The copy strategy between ``device`` and host memory."""
    if device.type == "cuda":
        return StreamCopies(device)
    if device.type == "cpu":
        return HostCopies()
    return BlockingCopies()
