"""Which reader reads a checkpoint folder: zengine's own, DeepSpeed's ZeRO files, its universal
checkpoints, or DCP's.

``find`` turns a load's directory and tag into one checkpoint folder (a DCP folder is a checkpoint by
itself: FSDP2 and torchtitan write no ``latest``); ``open_reader`` picks the reader by what the folder
holds. Every reader answers the same questions (``meta``, ``fill``, ``buffer_into``, ``read_buffer``,
``read_state``), so ``native/load.py`` loads any of them with one code path.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from .dcp import is_dcp_checkpoint
from .deepspeed.reader import DeepSpeedReader, is_deepspeed_checkpoint
from .deepspeed.universal import (
    LATEST_UNIVERSAL,
    UniversalReader,
    is_universal_checkpoint,
    universal_tag,
)
from .errors import CheckpointNotFoundError
from .native import atomic
from .native.reader import CheckpointReader


def find(load_dir: str, tag: Optional[str] = None, universal: bool = False) -> str:
    """The checkpoint folder of ``load_dir`` and ``tag`` (native/atomic.py's rules), or ``load_dir``
    itself when it is a DCP or universal folder and no tag is given. ``universal``
    (``checkpoint.load_universal``): no tag means the one in ``load_dir/latest_universal``."""
    if tag is None and (is_dcp_checkpoint(load_dir) or is_universal_checkpoint(load_dir)):
        return load_dir
    if universal and tag is None and os.path.isdir(load_dir):
        tag = universal_tag(load_dir)
        if tag is None:
            raise CheckpointNotFoundError(
                f"{os.path.join(load_dir, LATEST_UNIVERSAL)} does not exist or is empty "
                "(checkpoint.load_universal is true): write the universal folder's name into it, "
                "as ds_to_universal does, or pass tag="
            )
    return atomic.find(load_dir, tag)


def open_reader(
    directory: str,
    trusted: bool,
    engine_groups: Sequence[Sequence[str]],
    gas: int,
    model: Optional[dict] = None,
):
    """The reader for ``directory``. ``model``: the engine's ``meta.describe_model`` (a DCP folder's
    keys are sorted into parameters, buffers and tied names by it)."""
    if is_dcp_checkpoint(directory):
        from .dcp.reader import (
            DcpReader,
        )  # torch.distributed.checkpoint only when a DCP folder is read

        return DcpReader(directory, trusted, engine_groups, gas, model)
    if is_universal_checkpoint(directory):  # (it holds DeepSpeed's model files too)
        return UniversalReader(directory, trusted, engine_groups, gas)
    if is_deepspeed_checkpoint(directory):
        return DeepSpeedReader(directory, trusted, engine_groups, gas)
    return CheckpointReader(directory)
