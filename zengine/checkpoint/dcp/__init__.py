"""PyTorch's distributed checkpoints (DCP: ``torch.distributed.checkpoint``, the format of FSDP2 and
torchtitan), both ways; modules listed in ``zengine/checkpoint/__init__.py``. Only this package's
modules import torch.distributed.checkpoint, and only when a DCP folder is read or written."""

from __future__ import annotations

import os

METADATA = ".metadata"  # DCP writes it last: a folder without it is a save that did not finish
SUFFIX = ".distcp"


def is_dcp_checkpoint(directory: str) -> bool:
    """Whether ``directory`` is a DCP folder: its ``.metadata`` or ``*.distcp`` files (a partial one too,
    so that the load names what is missing)."""
    if not os.path.isdir(directory):
        return False
    return any(n == METADATA or n.endswith(SUFFIX) for n in os.listdir(directory))
