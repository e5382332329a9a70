"""``zengine.utils``: what DeepSpeed scripts import from ``deepspeed.utils``.

- ``logger`` and ``log_dist(message, ranks)``, also in ``utils.logging`` (DeepSpeed's module);
- ``RepeatingLoader``;
- ``safe_get_full_fp32_param``, ``safe_set_full_fp32_param``, ``safe_get_full_grad``,
  ``safe_get_full_optimizer_state``, ``safe_set_full_optimizer_state``: one parameter whole,
  whatever the stage shards (collectives: every rank calls them; ``zero/full_state.py``);
- ``zero_to_fp32``: the full fp32 state_dict of a sharded checkpoint, in one process;
- ``set_z3_leaf_modules``, ``unset_z3_leaf_modules``, ``get_z3_leaf_modules``, ``z3_leaf_module``:
  stage-3 leaf modules, gathered whole (``zero/stage3/leaf.py``; mixture-of-experts layers).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime.dataloader import RepeatingLoader
from ..zero import full_state
from ..zero.stage3.leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from . import logging, zero_to_fp32
from .logging import log_dist, logger


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


def safe_get_full_optimizer_state(
    param: torch.nn.Parameter, optim_state_key: str
) -> Optional[torch.Tensor]:
    """The whole optimizer state ``optim_state_key`` (``exp_avg``, ``exp_avg_sq``) of ``param`` (collective)."""
    return full_state.get_full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set ``param``'s optimizer state ``optim_state_key`` to ``value`` (the same on every rank)."""
    full_state.set_full_optimizer_state(param, value, optim_state_key)


__all__ = [
    "logger",
    "log_dist",
    "logging",
    "RepeatingLoader",
    "safe_get_full_fp32_param",
    "safe_set_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state",
    "zero_to_fp32",
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
