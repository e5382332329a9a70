"""``deepspeed.utils.logging`` as libraries use it: ``logger`` (the zengine logger, whose level
Lightning's DeepSpeed strategies set with ``deepspeed.utils.logging.logger.setLevel``) and
``log_dist(message, ranks)``."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from ..log import setup_logging

logger = setup_logging()


def log_dist(
    message: str, ranks: Optional[Sequence[int]] = None, level: int = logging.INFO
) -> None:
    """Log ``message`` on the ranks listed (every rank when the list starts with -1; none when it is
    empty or None), as DeepSpeed does; before the process group exists, always (as rank -1)."""
    import torch.distributed as dist

    started = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if started else -1
    ranks = list(ranks or [])
    if not started or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")


__all__ = ["logger", "log_dist"]
