"""Named random streams (DeepSpeed's ``CudaRNGStatesTracker``), replayed by the recomputation."""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Dict, Iterator, Optional, Tuple

import torch

from ..device import get_accelerator
from ..distributed.process_group import world_rank

logger = logging.getLogger("zengine")

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's (and Megatron's) name of the tracked stream

# (CPU generator state, the current CUDA device's or None)
RNGState = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _on_cuda() -> bool:
    """Whether this process computes on CUDA: the CUDA generator is touched only then (a CPU run
    on a GPU host must not create a CUDA context)."""
    return get_accelerator().name == "cuda"


def _rng_state() -> RNGState:
    cuda = torch.cuda.get_rng_state() if _on_cuda() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: RNGState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class CudaRNGStatesTracker:
    """Named random streams that code can switch to for a while (DeepSpeed's tracker).

    ``add(name, seed)`` creates a stream; ``with tracker.fork(name):`` makes random ops draw from
    it, and on exit the default stream continues where it was, untouched. A stream covers both the
    CPU generator and the current CUDA device's (when there is CUDA), since a zengine rank computes
    on either. In DeepSpeed the tracked stream differs between model-parallel ranks (dropout inside
    a tensor-parallel layer); with no model parallelism every rank has the same one.
    """

    def __init__(self):
        self.states_: Dict[str, RNGState] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, RNGState]:
        """A copy of the name -> state table (the states themselves are immutable snapshots)."""
        return copy.copy(self.states_)

    def set_states(self, states: Dict[str, RNGState]) -> None:
        """Replace the table (as ``get_states`` returned it)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; a name or seed used before is an error."""
        if seed in self.seeds_:
            raise ValueError(
                f"CudaRNGStatesTracker.add: seed {seed} is already used by another stream"
            )
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a stream named {name!r} already exists")
        self.seeds_.add(seed)
        previous = _rng_state()
        torch.manual_seed(seed)
        self.states_[name] = _rng_state()
        _set_rng_state(previous)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw random numbers from stream ``name`` inside the block; the default stream after."""
        if name not in self.states_:
            raise KeyError(
                f"CudaRNGStatesTracker.fork: no stream named {name!r}; add it first (or "
                f"call model_parallel_cuda_manual_seed)"
            )
        previous = _rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _rng_state()
            _set_rng_state(previous)


TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker of named random streams (see ``CudaRNGStatesTracker``)."""
    return TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default random stream with ``seed`` and (re)create the tracker's model-parallel
    stream, as DeepSpeed and Megatron do, for one model-parallel rank: the default stream (dropout
    outside tensor-parallel layers) gets ``seed``, the ``"model-parallel-rng"`` stream
    ``seed + 2718`` plus the model-parallel rank, which is always 0 here. Call it with the same
    seed on every rank and both streams are the same on every rank."""
    TRACKER.reset()
    torch.manual_seed(seed)
    TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718)
    if world_rank() == 0:
        logger.info(
            "model_parallel_cuda_manual_seed: default stream seed %d, %r stream seed %d "
            "(model-parallel rank 0 of 1)",
            seed,
            MODEL_PARALLEL_RNG,
            seed + 2718,
        )
