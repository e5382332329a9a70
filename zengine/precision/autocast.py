"""How the forward computes, chosen once from the config: on the parameters' own dtype
(``PlainForward``: fp32, or the fp16/bf16 sections' 16-bit parameters) or under ``torch.autocast``
on fp32 parameters (``AutocastForward``: DeepSpeed's ``torch_autocast`` section).

Under autocast the parameters, their gradients and the masters stay fp32; the ops autocast lists
run in the autocast dtype. DeepSpeed then reduces the gradients of the "lower-precision-safe"
modules' parameters (``nn.Linear`` and ``nn.Conv*`` by default: their products ran in the autocast
dtype, so their gradients carry no more precision than it) across ranks in that dtype, and every
other gradient in fp32 (``wire_dtypes``). fp16 autocast needs a loss scale: torch's ``GradScaler``
defaults (2**16, halved on overflow, doubled after 2000 clean steps), as DeepSpeed uses one.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import ContextManager, Iterable, Optional

import torch
from torch import nn

from ..config.precision import DTYPES
from .loss_scaler import DynamicLossScaler, LossScaler, make_loss_scaler

logger = logging.getLogger("zengine")

# torch.amp.GradScaler's defaults: init_scale 2**16, growth_interval 2000, backoff 0.5 at once.
_GRAD_SCALER_POWER, _GRAD_SCALER_WINDOW = 16, 2000


class ForwardPrecision:
    """The forward's precision: the context the forward runs in, the loss scaler and which
    parameters' gradients cross the ranks in another dtype than the rest."""

    def context(self) -> ContextManager:
        """The context ``engine(...)`` runs the module in."""
        return contextlib.nullcontext()

    def loss_scaler(self, fp16) -> LossScaler:
        """The loss scaler for the ``fp16`` section (an ``FP16Config``)."""
        return make_loss_scaler(fp16)

    def wire_dtypes(self, model: nn.Module) -> dict[int, torch.dtype]:
        """``id(parameter) -> dtype`` for the parameters whose gradients are reduced in a dtype of
        their own (empty: every gradient in the engine's reduce dtype)."""
        return {}

    def describe(self) -> Optional[str]:
        """One line for the log (None: nothing to say)."""
        return None


class PlainForward(ForwardPrecision):
    """The forward on the parameters' own dtype (fp32, or the fp16/bf16 sections'). An autocast
    the script opened around ``engine(...)`` is turned off inside it, as DeepSpeed does: the
    config's precision sections decide (``torch_autocast`` is the way to compute under autocast)."""

    _warned = False  # (once per process)

    def __init__(self, device_type: str):
        self.device_type = device_type
        # (a device autocast does not know, such as "meta", cannot have one open)
        self.autocast_known = torch.amp.is_autocast_available(device_type)

    def context(self) -> ContextManager:
        if not self.autocast_known or not torch.is_autocast_enabled(self.device_type):
            return contextlib.nullcontext()
        if not PlainForward._warned:
            PlainForward._warned = True
            logger.warning(
                "zengine: torch.autocast is on around engine(...) but the config's torch_autocast "
                "is off: the engine's forward runs without it, as DeepSpeed's does (enable the "
                "torch_autocast section to compute under autocast)"
            )
        return torch.autocast(device_type=self.device_type, enabled=False)


class AutocastForward(ForwardPrecision):
    """The forward under ``torch.autocast(device_type, dtype)`` on fp32 parameters; the gradients of
    ``safe_modules``' parameters are reduced in ``dtype`` (``reduce_lower``: stages 1-3, as
    DeepSpeed; at stage 0 every gradient is reduced in the engine's reduce dtype)."""

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype,
        safe_modules: Iterable[type],
        reduce_lower: bool,
    ):
        self.device_type = device_type
        self.dtype = dtype
        self.safe_modules = tuple(safe_modules)
        self.reduce_lower = reduce_lower

    def context(self) -> ContextManager:
        # An autocast the script opened around engine(...) is replaced by the config's, as DeepSpeed.
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, enabled=True)

    def loss_scaler(self, fp16) -> LossScaler:
        if self.dtype is not torch.float16:
            return LossScaler()
        # (hysteresis 1: halve at the first overflow; no floor, like GradScaler)
        return DynamicLossScaler(
            2.0**_GRAD_SCALER_POWER, _GRAD_SCALER_WINDOW, 1, torch.finfo(torch.float32).tiny
        )

    def wire_dtypes(self, model: nn.Module) -> dict[int, torch.dtype]:
        if not self.reduce_lower:
            return {}
        out = {}
        for module in model.modules():
            if type(module) in self.safe_modules:  # the class itself, not a subclass, as DeepSpeed
                for p in module.parameters(recurse=False):
                    out[id(p)] = self.dtype
        return out

    def describe(self) -> Optional[str]:
        names = ", ".join(c.__name__ for c in self.safe_modules)
        where = f"{names} gradients reduced in it" if self.reduce_lower else "fp32 reductions"
        return f"torch_autocast: forward under torch.autocast({self.dtype}), {where}"


def import_module_class(path: str) -> type:
    """The class named by ``path`` ("torch.nn.Linear"); raises ``ValueError`` naming it."""
    package, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(package), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"torch_autocast.lower_precision_safe_modules: cannot import {path!r} ({e}); give "
            "module classes by import path, such as \"torch.nn.Linear\""
        ) from None
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(
            f"torch_autocast.lower_precision_safe_modules: {path!r} is not an nn.Module class"
        )
    return found


def forward_precision(autocast_cfg, device: torch.device, stage: int) -> ForwardPrecision:
    """The forward precision for the ``torch_autocast`` section (a ``TorchAutocastConfig``) on
    ``device`` at ZeRO ``stage``."""
    if not autocast_cfg.enabled:
        return PlainForward(torch.device(device).type)
    device_type = torch.device(device).type
    dtype = (
        DTYPES[autocast_cfg.dtype]
        if autocast_cfg.dtype is not None
        else torch.get_autocast_dtype(device_type)
    )
    classes = [import_module_class(path) for path in autocast_cfg.safe_modules]
    return AutocastForward(device_type, dtype, classes, reduce_lower=stage >= 1)
