"""Which reader reads a checkpoint folder: zengine's own, DeepSpeed's ZeRO files, or DCP's.

``find`` turns a load's directory and tag into one checkpoint folder (a DCP folder is a checkpoint by
itself: FSDP2 and torchtitan write no ``latest``); ``open_reader`` picks the reader by what the folder
holds. Every reader answers the same questions (``meta``, ``fill``, ``buffer_into``, ``read_buffer``,
``read_state``), so ``native/load.py`` loads any of them with one code path.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .dcp import is_dcp_checkpoint
from .deepspeed.reader import DeepSpeedReader, is_deepspeed_checkpoint
from .native import atomic
from .native.reader import CheckpointReader


def find(load_dir: str, tag: Optional[str] = None) -> str:
    """The checkpoint folder of ``load_dir`` and ``tag`` (native/atomic.py's rules), or ``load_dir``
    itself when it is a DCP folder and no tag is given."""
    if tag is None and is_dcp_checkpoint(load_dir):
        return load_dir
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
    if is_deepspeed_checkpoint(directory):
        return DeepSpeedReader(directory, trusted, engine_groups, gas)
    return CheckpointReader(directory)
