"""The ``activation_checkpointing`` section: the settings ``zengine.checkpointing`` applies at ``initialize``."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import Count, Flag, _Section


class ActivationCheckpointingConfig(_Section):
    """How ``zengine.checkpointing.checkpoint`` (DeepSpeed's ``deepspeed.checkpointing``) keeps the inputs
    of each checkpointed segment. Recomputation is exact, so none of these changes the numbers."""

    partition_activations: Flag = Field(
        False,
        description="Split each saved input across the model-parallel "
        "group; accepted, no effect (zengine has no model "
        "parallelism, so the group is one rank).",
    )
    cpu_checkpointing: Flag = Field(
        False,
        description="Keep each checkpointed segment's saved inputs in CPU "
        "memory and copy them back to the device to recompute.",
    )
    contiguous_memory_optimization: Flag = Field(
        False,
        description="Copy partitioned inputs into preallocated "
        "contiguous buffers; accepted, no effect "
        "(nothing is partitioned here).",
    )
    number_checkpoints: Optional[Count] = Field(
        None,
        description="Checkpointed segments per forward, which "
        "sizes the contiguous buffers; accepted, no "
        "effect.",
    )
    synchronize_checkpoint_boundary: Flag = Field(
        False,
        description="Wait for the accelerator at the start "
        "and end of every checkpointed forward "
        "and recomputation (no-op on the CPU).",
    )
    profile: Flag = Field(
        False, description="Log the time of every checkpointed forward and recomputation."
    )
