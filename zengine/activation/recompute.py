"""``checkpoint(function, *args)``: run ``function`` without keeping the tensors it saves for
backward; backward runs it again (recomputation) to get them.

It is built on ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: gradients reach
parameters and inputs exactly as without checkpointing, and the CPU and CUDA random states are
replayed, so dropout draws the same masks in the recomputation. The named streams of
``get_cuda_rng_tracker()`` (``rng.py``) are replayed too (torch does not know them).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
from typing import Any, Callable, Deque, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.overrides import _get_current_function_mode_stack  # what torch's checkpoint reads too

from .rng import TRACKER
from .settings import CheckpointSettings, current

logger = logging.getLogger("zengine")


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` without keeping what it saves for backward; backward recomputes it.

    Returns what ``function`` returns, shaped as DeepSpeed shapes it: a tuple or list of one
    element comes back as that element, a longer one as a tuple; anything else (a tensor, a
    dict) as it is. Gradients are those of ``function(*args)`` without checkpointing (torch's
    non-reentrant checkpoint: it also works when no input requires grad, and under
    ``torch.autograd.grad``). Without grad enabled it simply runs ``function``.
    """
    settings = current()
    boundary = Boundary(settings, args)
    run = Replayed(function, boundary)
    host = SAVED_ON_HOST.hooks() if settings.cpu_checkpointing else contextlib.nullcontext()
    boundary.start()
    with host:  # outside torch's checkpoint, where only the segment's inputs are saved
        out = torch_checkpoint.checkpoint(run, *args, use_reentrant=False)
    boundary.stop("forward")
    if isinstance(out, (tuple, list)):
        return out[0] if len(out) == 1 else tuple(out)
    return out


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant variant; ``checkpoint`` here always is one."""


class Replayed:
    """``function`` for torch's checkpoint: each call after the first is a recomputation, run as the
    forward ran (timed and synchronised like it):

    - with the tracker's named RNG streams as they were at the forward (torch replays only the
      default generators);
    - under the torch-function modes that were active at the forward and no longer are in backward.
      Stage 3 gathers a parameter used outside its own module (``F.linear(x, other.weight)``)
      through such a mode, entered only around the engine's forward (``zero/stage3/hooks.py``,
      ``ExternalParamMode``); without it the recomputation would read the released, empty parameter.
    """

    def __init__(self, function: Callable[..., Any], boundary: "Boundary"):
        self.function, self.boundary = function, boundary
        self.tracker_states = TRACKER.get_states()
        self.modes = list(_get_current_function_mode_stack())
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.function(*args)
        after_forward = TRACKER.get_states()
        TRACKER.set_states(dict(self.tracker_states))
        self.boundary.start()
        try:
            with contextlib.ExitStack() as modes:
                active = {id(mode) for mode in _get_current_function_mode_stack()}
                for mode in self.modes:  # outermost first, as they were stacked
                    if id(mode) not in active:
                        modes.enter_context(mode)
                return self.function(*args)
        finally:  # torch usually ends a recomputation early, raising once backward has its tensors
            TRACKER.set_states(after_forward)
            self.boundary.stop("recompute")


_segments = itertools.count(1)


class Boundary:
    """Synchronisation and timing at the edges of one checkpointed segment."""

    def __init__(self, settings: CheckpointSettings, args: Tuple[Any, ...]):
        self.sync = settings.synchronize_checkpoint_boundary
        self.profile = settings.profile
        cuda = {a.device for a in args if torch.is_tensor(a) and a.device.type == "cuda"}
        self.devices = sorted(cuda, key=str)
        self.segment = next(_segments) if self.profile else 0
        self.began = 0.0

    def start(self) -> None:
        """The segment (its forward or its recomputation) begins."""
        if self.sync or self.profile:
            self._wait()
        self.began = time.perf_counter()

    def stop(self, phase: str) -> None:
        """The segment's ``phase`` ends: wait and log as the settings say."""
        if self.sync or self.profile:
            self._wait()
        if self.profile:
            logger.info(
                "activation checkpoint %d: %s %.3f ms",
                self.segment,
                phase,
                1e3 * (time.perf_counter() - self.began),
            )

    def _wait(self) -> None:
        for device in self.devices:
            torch.cuda.synchronize(device)


class SavedOnHost:
    """Saved-tensor hooks that keep saved tensors in CPU memory until backward unpacks them
    (``cpu_checkpointing``).

    Around torch's checkpoint call the only tensors saved are the segment's inputs (what the
    segment saves inside is replaced by torch's recomputation placeholders), so these are exactly
    the checkpointed inputs. Counts are kept for tests and the benchmark.
    """

    def __init__(self):
        self.packed = 0  # tensors packed (saved) under cpu_checkpointing
        self.moved_bytes = 0  # bytes copied from a device to the host
        self.unpacked = 0  # tensors handed back to a recomputation
        # where recent ones were kept
        self.host_devices: Deque[torch.device] = collections.deque(maxlen=1024)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context in which saved tensors go to the host."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Tuple[torch.device, torch.Tensor]:
        self.packed += 1
        if tensor.device.type == "cpu":
            host = tensor  # already in CPU memory; a copy would only double it
        else:
            # Pinned host memory lets the copies run asynchronously on the device's stream;
            # backward's copy back is queued after this one on the same stream, so no explicit
            # wait is needed.
            pin = tensor.device.type == "cuda"
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            host.copy_(tensor, non_blocking=pin)
            self.moved_bytes += tensor.numel() * tensor.element_size()
        self.host_devices.append(host.device)
        return tensor.device, host

    def _unpack(self, packed: Tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        self.unpacked += 1
        return host.to(device, non_blocking=host.is_pinned())

    def reset_counts(self) -> None:
        """Zero the counts."""
        self.packed = self.moved_bytes = self.unpacked = 0
        self.host_devices.clear()


SAVED_ON_HOST = SavedOnHost()
