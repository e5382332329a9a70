"""Helpers of ``deepspeed.runtime.utils`` that scripts call."""

from __future__ import annotations

import random

import torch

from ..log import setup_logging


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (every device) with ``seed``."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)  # the CPU and every CUDA device


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the memory rank 0 uses, with ``message`` (only when ``force``, as in DeepSpeed)."""
    from ..comm import get_rank

    if not force or get_rank() != 0:
        return
    from ..accelerator import get_accelerator

    acc = get_accelerator()
    setup_logging().info(
        "%s | allocated %.2f GB, peak %.2f GB",
        message,
        acc.memory_allocated() / 2**30,
        acc.max_memory_allocated() / 2**30,
    )
