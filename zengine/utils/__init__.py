"""``zengine.utils``: what DeepSpeed scripts import from ``deepspeed.utils``.

- ``logger`` and ``log_dist(message, ranks)``;
- ``RepeatingLoader``;
- ``safe_get_full_fp32_param``, ``safe_set_full_fp32_param``, ``safe_get_full_grad``,
  ``safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state``: one parameter whole,
  whatever the stage shards (collectives: every rank calls them; ``zero/full_state.py``);
- ``zero_to_fp32``: the full fp32 state_dict of a sharded checkpoint, in one process;
- ``set_z3_leaf_modules``, ``unset_z3_leaf_modules``, ``get_z3_leaf_modules``, ``z3_leaf_module``:
  stage-3 leaf modules, gathered whole (``zero/stage3/leaf.py``; mixture-of-experts layers).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from ..log import setup_logging
from ..runtime.dataloader import RepeatingLoader
from ..zero import full_state
from ..zero.stage3.leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from . import zero_to_fp32

logger = setup_logging()


def log_dist(message: str, ranks: Optional[Sequence[int]] = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed (every rank when the list starts with -1; none when it is
    empty or None), as DeepSpeed does; before the process group exists, always (as rank -1)."""
    import torch.distributed as dist

    started = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if started else -1
    ranks = list(ranks or [])
    if not started or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The whole fp32 master value of ``param`` (collective); None when no engine trains it."""
    return full_state.get_full_fp32_param(param)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master and its 16-bit copy to ``value`` (pass the same value on every rank)."""
    full_state.set_full_fp32_param(param, value)


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The whole fp32 gradient of ``param``, averaged over ranks and unscaled (collective): call it after
    ``engine.backward`` and before ``engine.step``."""
    return full_state.get_full_grad(param)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The whole optimizer state ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``) of ``param`` (collective)."""
    return full_state.get_full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set ``param``'s optimizer state ``optim_state_key`` to ``value`` (the same on every rank)."""
    full_state.set_full_optimizer_state(param, value, optim_state_key)


__all__ = ["logger", "log_dist", "RepeatingLoader", "safe_get_full_fp32_param", "safe_set_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "zero_to_fp32",
           "get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module"]
