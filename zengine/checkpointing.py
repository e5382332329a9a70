"""Activation checkpointing with DeepSpeed's ``deepspeed.checkpointing`` API.

    from zengine import checkpointing                 # DeepSpeed: deepspeed.checkpointing
    checkpointing.configure(None, checkpoint_in_cpu=True)
    x = checkpointing.checkpoint(block, x)          # in the model's forward

(Not to be confused with ``zengine.checkpoint``, which saves and loads model checkpoints.)

DeepSpeed's public name over ``zengine.activation``, where it is implemented: what each
``configure`` argument and config key means here (``activation/settings.py``), how a segment is
recomputed (``activation/recompute.py``), the named random streams (``activation/rng.py``).
"""

from .activation.recompute import SAVED_ON_HOST as _HOST_COPIES  # noqa: F401 (benchmarks read it)
from .activation.recompute import checkpoint, non_reentrant_checkpoint
from .activation.rng import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from .activation.settings import configure, configure_from_config, is_configured, reset

__all__ = [
    "configure",
    "configure_from_config",
    "is_configured",
    "reset",
    "checkpoint",
    "non_reentrant_checkpoint",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "CudaRNGStatesTracker",
]
