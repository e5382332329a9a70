"""``deepspeed.moe.utils``: the parameter-sorting helpers DeepSpeed scripts call. With no expert layers
(zengine builds none) no parameter is an expert's, so the answers are the plain ones."""

from __future__ import annotations

from typing import Any, Iterable, Union

import torch


def is_moe_param(param: torch.Tensor) -> bool:
    """True for a parameter of a DeepSpeed expert layer: never under zengine (it builds none)."""
    return False


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Union[dict, Iterable[dict]], max_group_size: Any = 178956971
) -> list[dict]:
    """DeepSpeed moves expert parameters into groups of their own; with none, every group stays as it is
    (a single group given as a dict comes back as a list of one, as DeepSpeed returns it)."""
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups)
