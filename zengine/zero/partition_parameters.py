"""``deepspeed.runtime.zero.partition_parameters`` as scripts and libraries import it: ``Init``,
``GatheredParameters``, ``ZeroParamStatus``, and the tensor-constructor hooks Hugging Face's
``from_config`` / ``from_pretrained`` swap around ``zero.Init`` (``zero_wrapper_for_fp_tensor_constructor``,
``_orig_torch_arange``).

zengine's ``Init`` leaves torch's tensor constructors alone (DeepSpeed's casts them to the compute
dtype and device); the hook is here so that code replacing and restoring it runs unchanged, and
a wrapper built with it keeps the constructor's dtype and places the tensor on ``target_device``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .init import GatheredParameters, Init
from .stage3.external import register_external_parameter, unregister_external_parameter
from .stage3.param import ZeroParameter, ZeroParamStatus

_orig_torch_arange = (
    torch.arange
)  # torch's own constructor, for code that recognises it in the hook


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable,
    target_fp_dtype: Optional[torch.dtype] = None,
    target_device: Optional[torch.device] = None,
) -> Callable:
    """``fn`` with ``device`` defaulting to ``target_device``; the dtype stays ``fn``'s (zengine's ``Init``
    does not recast constructors)."""

    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        return fn(*args, **kwargs)

    return wrapped


def get_accelerator():
    """``deepspeed.accelerator.get_accelerator``, which code reaching into this module also uses."""
    from ..device import get_accelerator as current

    return current()


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "ZeroParameter",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
