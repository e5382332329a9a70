"""Activation checkpointing: run a segment of the forward without keeping what it saves for
backward; backward runs it again (recomputation) to get them. DeepSpeed's public name for it is
``zengine.checkpointing`` (``deepspeed.checkpointing``), a face over this package; not to be
confused with ``zengine.checkpoint``, which saves and loads model checkpoints.

- ``settings.py``: ``configure`` and the config section, what each setting means here;
- ``recompute.py``: ``checkpoint(function, *args)`` on torch's non-reentrant checkpoint, the
  recomputation replayed as the forward ran, the saved inputs kept on the host;
- ``rng.py``: named random streams (``CudaRNGStatesTracker``), replayed in the recomputation.

At ZeRO stage 3 the recomputation runs the segment's modules again inside backward: their hooks
gather the parameters as in the forward, and a parameter read outside its own module is gathered
because the recomputation runs under the torch-function modes of the forward
(``recompute.Replayed``).
"""

from .recompute import SAVED_ON_HOST, SavedOnHost, checkpoint, non_reentrant_checkpoint
from .rng import CudaRNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from .settings import (
    CheckpointSettings,
    configure,
    configure_from_config,
    current,
    is_configured,
    reset,
    restore_defaults,
)

__all__ = [
    "CheckpointSettings",
    "CudaRNGStatesTracker",
    "SAVED_ON_HOST",
    "SavedOnHost",
    "checkpoint",
    "configure",
    "configure_from_config",
    "current",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "restore_defaults",
]
