"""The ``checkpoint`` section (DeepSpeed's checkpoint options).

zengine honours ``tag_validation`` in the only form its checkpoints allow: every rank writes into one
folder that appears whole or not at all (checkpoint/atomic.py), so ranks passing different tags always
fail, by name, before anything is written (DeepSpeed's ``Fail``); ``Ignore`` and ``Warn`` are accepted
for configs written for DeepSpeed and act the same. The section's other keys are in ``unsupported.py``:
``load_universal`` and ``use_node_local_storage`` and the ``writer`` sub-section are refused unless
inert, ``parallel_write`` (pipeline stages) is ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from .base import _Section


def _tag_validation(value: Any) -> Any:
    """DeepSpeed reads the mode in any case ("warn", "FAIL")."""
    return value.capitalize() if isinstance(value, str) else value


TagValidation = Annotated[Literal["Ignore", "Warn", "Fail"], BeforeValidator(_tag_validation)]


class CheckpointConfig(_Section):
    """Checkpoint options: tag validation."""

    tag_validation: TagValidation = Field("Warn", description=(
        "What to do when ranks save with different tags: zengine always fails (one folder per checkpoint, "
        "written by every rank); Ignore and Warn are accepted for DeepSpeed configs."))
