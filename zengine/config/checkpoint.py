"""The ``checkpoint`` section (DeepSpeed's checkpoint options): tag validation and the writer.

zengine honours ``tag_validation`` in the only form its checkpoints allow: every rank writes into one
folder that appears whole or not at all (checkpoint/atomic.py), so ranks passing different tags always
fail, by name, before anything is written (DeepSpeed's ``Fail``); ``Ignore`` and ``Warn`` are accepted
for configs written for DeepSpeed and act the same. ``load_universal`` makes a load follow ``latest_universal`` (DeepSpeed's universal
checkpoints, checkpoint/deepspeed/universal.py). ``checkpoint_format`` chooses what
``save_checkpoint`` writes (zengine's format or DCP, FSDP2's). ``writer.decoupled`` makes every
``save_checkpoint`` asynchronous (checkpoint/background.py), as DeepSpeed's decoupled writer does; the
writer's tuning keys are accepted and ignored. The section's other keys are in ``unsupported.py``:
``use_node_local_storage`` is refused unless inert, ``parallel_write``
(pipeline stages) is ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from .base import Flag, _Section


def _tag_validation(value: Any) -> Any:
    """DeepSpeed reads the mode in any case ("warn", "FAIL")."""
    return value.capitalize() if isinstance(value, str) else value


TagValidation = Annotated[Literal["Ignore", "Warn", "Fail"], BeforeValidator(_tag_validation)]


class CheckpointWriterConfig(_Section):
    """How checkpoints are written (DeepSpeed's ``checkpoint.writer``)."""

    type: Literal["python", "fast"] = Field(
        "python",
        description=(
            "DeepSpeed's writer implementation; zengine has one writer (streamed, fsynced, checksummed) for both."
        ),
    )
    decoupled: Flag = Field(
        False,
        description=(
            "Write in the background: save_checkpoint returns after a copy to host memory; the next save, "
            "load_checkpoint, wait_for_checkpoint() or destroy waits for it."
        ),
    )


class CheckpointConfig(_Section):
    """Checkpoint options: tag validation and the writer."""

    tag_validation: TagValidation = Field(
        "Warn",
        description=(
            "What to do when ranks save with different tags: zengine always fails (one folder per checkpoint, "
            "written by every rank); Ignore and Warn are accepted for DeepSpeed configs."
        ),
    )
    load_universal: Flag = Field(
        False,
        description=(
            "load_checkpoint(save_dir) reads the tag in save_dir/latest_universal: DeepSpeed's universal "
            "checkpoint (ds_to_universal's output), loaded at any stage and world size. A universal "
            "folder passed itself loads either way."
        ),
    )
    checkpoint_format: Literal["zengine", "dcp"] = Field(
        "zengine",
        description=(
            "What save_checkpoint writes: zengine's format, or 'dcp' (torch.distributed.checkpoint in "
            "get_state_dict's {'model', 'optim'} layout, which FSDP2 loads with dcp.load + set_state_dict). "
            "load_checkpoint reads either."
        ),
    )
    writer: CheckpointWriterConfig = Field(
        default_factory=CheckpointWriterConfig,
        description=("The checkpoint writer: decoupled (asynchronous) or not."),
    )
