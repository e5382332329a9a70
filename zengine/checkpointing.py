"""Activation checkpointing with DeepSpeed's ``deepspeed.checkpointing`` API.

    from zengine import checkpointing                 # DeepSpeed: deepspeed.checkpointing
    checkpointing.configure(None, checkpoint_in_cpu=True)
    x = checkpointing.checkpoint(block, x)          # in the model's forward

(Not to be confused with ``zengine.checkpoint``, which saves and loads model checkpoints.)

``checkpoint(function, *args)`` runs ``function`` without keeping the tensors
it saves for backward; backward runs it again (recomputation) to get them.
It is built on ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
gradients reach parameters and inputs exactly as without checkpointing, and
the CPU and CUDA random states are replayed, so dropout draws the same masks
in the recomputation. The named streams of ``get_cuda_rng_tracker()`` are
replayed too (torch does not know them).

What the settings mean here (``configure`` arguments, in brackets the keys
of the config's ``activation_checkpointing`` section):

- ``checkpoint_in_cpu`` [``cpu_checkpointing``]: the inputs each checkpointed
  segment keeps for its recomputation are copied to CPU memory (pinned when
  they come from CUDA) and back to their device when backward recomputes.
  Only these inputs are kept between forward and backward, so with every
  block checkpointed the device holds no activations at all between them.
- ``synchronize`` [``synchronize_checkpoint_boundary``]: wait for the CUDA
  devices of the segment's inputs at the start and end of every checkpointed
  forward and recomputation (a debugging and timing aid; nothing to wait
  for on the CPU).
- ``profile`` [``profile``]: log the wall time of every checkpointed forward
  and recomputation (synchronising CUDA around each, so the time is the
  work's, not its launch's).
- ``partition_activations``: DeepSpeed splits each saved input across the
  ranks of the model-parallel group (they hold identical copies) and
  gathers it for recomputation. zengine has no model parallelism: the group
  is this one rank, and the data-parallel ranks hold activations of
  different samples, which are not copies of each other. Accepted; nothing
  to partition, as in DeepSpeed with a model-parallel size of 1.
- ``contiguous_checkpointing`` [``contiguous_memory_optimization``] and
  ``num_checkpoints`` [``number_checkpoints``]: DeepSpeed copies the
  partitioned inputs into ``num_checkpoints`` preallocated buffers to avoid
  fragmentation; it requires ``partition_activations``, and so does
  ``configure`` here. With nothing partitioned the saved inputs are ordinary
  tensors of torch's allocator: accepted, no effect.

At ZeRO stage 3 the recomputation runs the segment's modules again inside
backward: their hooks gather the parameters as in the forward, and a
parameter read outside its own module is gathered because the recomputation
runs under the torch-function modes of the forward (``_Replayed``).

Where the settings come from: ``Engine`` applies the config's section at
``initialize`` (``configure_from_config``) unless the script has called
``configure`` itself, whose settings then stay; a later ``configure`` call
replaces them. ``is_configured()`` says whether ``configure`` was called, as
in DeepSpeed.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable, Deque, Dict, Iterator, Optional, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from pydantic import ValidationError
from torch.overrides import _get_current_function_mode_stack  # what torch's checkpoint reads too

from .comm import get_rank
from .config.activation_checkpointing import ActivationCheckpointingConfig

logger = logging.getLogger("zengine")

__all__ = ["configure", "configure_from_config", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker"]


# -- settings ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Settings:
    """The settings ``checkpoint`` reads; field names are the config section's keys."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @classmethod
    def of(cls, section: ActivationCheckpointingConfig) -> "_Settings":
        return cls(**{f.name: getattr(section, f.name) for f in fields(cls)})


# configure()'s arguments and the section keys they set.
_ARGUMENT_KEYS = {"partition_activations": "partition_activations",
                  "contiguous_checkpointing": "contiguous_memory_optimization",
                  "num_checkpoints": "number_checkpoints",
                  "checkpoint_in_cpu": "cpu_checkpointing",
                  "synchronize": "synchronize_checkpoint_boundary",
                  "profile": "profile"}

_settings = _Settings()
_configured = False  # configure() was called (DeepSpeed's is_configured)


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """Set how ``checkpoint`` works, with DeepSpeed's parameters in DeepSpeed's order.

    Starts from the defaults (all off), then applies the ``activation_checkpointing``
    section of ``deepspeed_config`` (a path to a JSON file, a dict, a config from
    ``zengine.config.load_config``, or an ``ActivationCheckpointingConfig``), then every
    argument that is not None. The module docstring says what each setting does here.

    ``mpu_`` must be None: it is DeepSpeed's model-parallel unit, and zengine has no model
    parallelism. Raises ``ValueError`` for an mpu, for a bad value (naming the argument or
    the config key), and, as DeepSpeed does, for ``contiguous_checkpointing`` without
    ``partition_activations`` or without ``num_checkpoints``.
    """
    global _settings, _configured
    if mpu_ is not None:
        raise ValueError(f"zengine.checkpointing.configure: mpu_={type(mpu_).__name__} object given, but zengine "
                         f"has no model parallelism (tensor or pipeline), so there is no model-parallel unit to "
                         f"use; pass mpu_=None")
    values: Dict[str, Any] = {}
    if deepspeed_config is not None:
        values = _section_of(deepspeed_config).model_dump()
    arguments = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
                 "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
                 "synchronize": synchronize, "profile": profile}
    given = {name: value for name, value in arguments.items() if value is not None}
    for name, value in given.items():
        values[_ARGUMENT_KEYS[name]] = value
    try:
        section = ActivationCheckpointingConfig.model_validate(values)
    except ValidationError as error:
        by_key = {key: name for name, key in _ARGUMENT_KEYS.items() if name in given}
        problems = [f"{by_key.get(str(item['loc'][0]), 'activation_checkpointing.' + str(item['loc'][0]))}: "
                    f"{item['msg']} (got {item.get('input')!r})" for item in error.errors()]
        raise ValueError("zengine.checkpointing.configure:\n  " + "\n  ".join(problems)) from None
    if section.contiguous_memory_optimization and not section.partition_activations:
        raise ValueError("zengine.checkpointing.configure: contiguous_checkpointing (contiguous_memory_optimization) "
                         "needs partition_activations, as in DeepSpeed")
    if section.contiguous_memory_optimization and section.number_checkpoints is None:
        raise ValueError("zengine.checkpointing.configure: contiguous_checkpointing (contiguous_memory_optimization) "
                         "needs num_checkpoints (number_checkpoints), as in DeepSpeed")
    _settings = _Settings.of(section)
    _configured = True
    if get_rank() == 0:
        logger.info("activation checkpointing configured: %s", _describe(_settings))


def configure_from_config(section: ActivationCheckpointingConfig) -> None:
    """Apply the config's ``activation_checkpointing`` section; called by the engine at ``initialize``.

    A script that called ``configure`` keeps its settings (in DeepSpeed the engine never
    touches them; there, the section acts only through ``configure(deepspeed_config=...)``).
    Does not change ``is_configured()``.
    """
    global _settings
    if _configured:
        if _Settings.of(section) != _settings and get_rank() == 0:
            logger.info("activation checkpointing: keeping the settings of checkpointing.configure() (%s) over "
                        "the config's activation_checkpointing section", _describe(_settings))
        return
    _settings = _Settings.of(section)


def is_configured() -> bool:
    """True once ``configure`` has been called (DeepSpeed's meaning; settings from the config alone do
    not count). ``checkpoint`` works either way."""
    return _configured


def reset() -> None:
    """DeepSpeed's reset: free the contiguous checkpoint buffers that a forward without backward
    (evaluation) leaves behind. zengine keeps no such buffers (see ``contiguous_checkpointing``),
    so there is nothing to free; the settings stay, as in DeepSpeed."""


def _restore_defaults() -> None:
    """Back to the state of a fresh process: default settings, not configured (for tests)."""
    global _settings, _configured
    _settings, _configured = _Settings(), False


def _describe(settings: _Settings) -> str:
    return ", ".join(f"{f.name}={getattr(settings, f.name)}" for f in fields(settings))


def _section_of(config: Any) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a config path, dict or loaded config. Only that
    section is read and checked (DeepSpeed checks the whole file here, batch sizes included, which
    needs the world size; the engine checks the whole file at initialize)."""
    from .config.load import ConfigError, _describe as describe_errors, _read  # the loader's reading and wording
    from .config.models import ZengineConfig

    if isinstance(config, ActivationCheckpointingConfig):
        return config
    if isinstance(config, ZengineConfig):
        return config.activation_checkpointing
    if not isinstance(config, (str, os.PathLike, Mapping)):
        raise ValueError(f"zengine.checkpointing.configure: deepspeed_config must be a path to a JSON file, a dict "
                         f"or a loaded config, got {type(config).__name__}")
    source, raw = _read(config)
    try:
        loaded = ZengineConfig.model_validate({"activation_checkpointing": raw.get("activation_checkpointing")})
    except ValidationError as error:
        raise ConfigError(f"invalid activation_checkpointing section in {source}:\n"
                          + "\n".join(f"  {line}" for line in describe_errors(error))) from None
    return loaded.activation_checkpointing


# -- checkpoint -------------------------------------------------------------------------------------
def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` without keeping what it saves for backward; backward recomputes it.

    Returns what ``function`` returns, shaped as DeepSpeed shapes it: a tuple or list of one
    element comes back as that element, a longer one as a tuple; anything else (a tensor, a
    dict) as it is. Gradients are those of ``function(*args)`` without checkpointing (torch's
    non-reentrant checkpoint: it also works when no input requires grad, and under
    ``torch.autograd.grad``). Without grad enabled it simply runs ``function``.
    """
    settings = _settings
    boundary = _Boundary(settings, args)
    run = _Replayed(function, boundary)
    host = _HOST_COPIES.hooks() if settings.cpu_checkpointing else contextlib.nullcontext()
    boundary.start()
    with host:  # outside torch's checkpoint, where only the segment's inputs are saved
        out = torch_checkpoint.checkpoint(run, *args, use_reentrant=False)
    boundary.stop("forward")
    if isinstance(out, (tuple, list)):
        return out[0] if len(out) == 1 else tuple(out)
    return out


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant variant; ``checkpoint`` here always is one."""


class _Replayed:
    """``function`` for torch's checkpoint: each call after the first is a recomputation, run as the
    forward ran (timed and synchronised like it):

    - with the tracker's named RNG streams as they were at the forward (torch replays only the
      default generators);
    - under the torch-function modes that were active at the forward and no longer are in backward.
      Stage 3 gathers a parameter used outside its own module (``F.linear(x, other.weight)``)
      through such a mode, entered only around the engine's forward (``zero/stage3/hooks.py``,
      ``ExternalParamMode``); without it the recomputation would read the released, empty parameter.
    """

    def __init__(self, function: Callable[..., Any], boundary: "_Boundary"):
        self.function, self.boundary = function, boundary
        self.tracker_states = _TRACKER.get_states()
        self.modes = list(_get_current_function_mode_stack())
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.function(*args)
        after_forward = _TRACKER.get_states()
        _TRACKER.set_states(dict(self.tracker_states))
        self.boundary.start()
        try:
            with contextlib.ExitStack() as modes:
                active = {id(mode) for mode in _get_current_function_mode_stack()}
                for mode in self.modes:  # outermost first, as they were stacked
                    if id(mode) not in active:
                        modes.enter_context(mode)
                return self.function(*args)
        finally:  # torch usually ends a recomputation early, by raising once it has what backward needs
            _TRACKER.set_states(after_forward)
            self.boundary.stop("recompute")


_segments = itertools.count(1)


class _Boundary:
    """Synchronisation and timing at the edges of one checkpointed segment."""

    def __init__(self, settings: _Settings, args: Tuple[Any, ...]):
        self.sync = settings.synchronize_checkpoint_boundary
        self.profile = settings.profile
        self.devices = sorted({a.device for a in args if torch.is_tensor(a) and a.device.type == "cuda"}, key=str)
        self.segment = next(_segments) if self.profile else 0
        self.began = 0.0

    def start(self) -> None:
        if self.sync or self.profile:
            self._wait()
        self.began = time.perf_counter()

    def stop(self, phase: str) -> None:
        if self.sync or self.profile:
            self._wait()
        if self.profile:
            logger.info("activation checkpoint %d: %s %.3f ms", self.segment, phase,
                        1e3 * (time.perf_counter() - self.began))

    def _wait(self) -> None:
        for device in self.devices:
            torch.cuda.synchronize(device)


class _HostCopies:
    """Saved-tensor hooks that keep saved tensors in CPU memory until backward unpacks them.

    Around torch's checkpoint call the only tensors saved are the segment's inputs (what the
    segment saves inside is replaced by torch's recomputation placeholders), so these are exactly
    the checkpointed inputs. Counts are kept for tests and the benchmark.
    """

    def __init__(self):
        self.packed = 0          # tensors packed (saved) under cpu_checkpointing
        self.moved_bytes = 0     # bytes copied from a device to the host
        self.unpacked = 0        # tensors handed back to a recomputation
        self.host_devices: Deque[torch.device] = collections.deque(maxlen=1024)  # where recent ones were kept

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Tuple[torch.device, torch.Tensor]:
        self.packed += 1
        if tensor.device.type == "cpu":
            host = tensor  # already in CPU memory; a copy would only double it
        else:
            # Pinned host memory lets the copies run asynchronously on the device's stream; backward's
            # copy back is queued after this one on the same stream, so no explicit wait is needed.
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


_HOST_COPIES = _HostCopies()


# -- RNG streams ------------------------------------------------------------------------------------
_MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's (and Megatron's) name of the tracked stream

_RNGState = Tuple[torch.Tensor, Optional[torch.Tensor]]  # (CPU generator state, current CUDA device's or None)


def _on_cuda() -> bool:
    """Whether this process computes on CUDA: the CUDA generator is touched only then (a CPU run on a GPU
    host must not create a CUDA context)."""
    from .accelerator import get_accelerator

    return get_accelerator().name == "cuda"


def _rng_state() -> _RNGState:
    cuda = torch.cuda.get_rng_state() if _on_cuda() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: _RNGState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class CudaRNGStatesTracker:
    """Named random streams that code can switch to for a while (DeepSpeed's ``CudaRNGStatesTracker``).

    ``add(name, seed)`` creates a stream; ``with tracker.fork(name):`` makes random ops draw from
    it, and on exit the default stream continues where it was, untouched. A stream covers both the
    CPU generator and the current CUDA device's (when there is CUDA), since a zengine rank computes
    on either. In DeepSpeed the tracked stream differs between model-parallel ranks (dropout inside
    a tensor-parallel layer); with no model parallelism every rank has the same one.
    """

    def __init__(self):
        self.states_: Dict[str, _RNGState] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, _RNGState]:
        """A copy of the name -> state table (the states themselves are immutable snapshots)."""
        return copy.copy(self.states_)

    def set_states(self, states: Dict[str, _RNGState]) -> None:
        """Replace the table (as ``get_states`` returned it)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; a name or seed used before is an error."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a stream named {name!r} already exists")
        self.seeds_.add(seed)
        previous = _rng_state()
        torch.manual_seed(seed)
        self.states_[name] = _rng_state()
        _set_rng_state(previous)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw random numbers from stream ``name`` inside the block; restore the default stream after."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no stream named {name!r}; add it first (or call "
                           f"model_parallel_cuda_manual_seed)")
        previous = _rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _rng_state()
            _set_rng_state(previous)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker of named random streams (see ``CudaRNGStatesTracker``)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default random stream with ``seed`` and (re)create the tracker's model-parallel
    stream, as DeepSpeed and Megatron do, for one model-parallel rank: the default stream (dropout
    outside tensor-parallel layers) gets ``seed``, the ``"model-parallel-rng"`` stream
    ``seed + 2718`` plus the model-parallel rank, which is always 0 here. Call it with the same
    seed on every rank and both streams are the same on every rank."""
    _TRACKER.reset()
    torch.manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + 2718)
    if get_rank() == 0:
        logger.info("model_parallel_cuda_manual_seed: default stream seed %d, %r stream seed %d (model-parallel "
                    "rank 0 of 1)", seed, _MODEL_PARALLEL_RNG, seed + 2718)
