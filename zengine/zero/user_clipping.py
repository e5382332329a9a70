"""A script's own ``torch.nn.utils.clip_grad_norm_`` (or ``clip_grad_value_``,
``clip_grads_with_norm_``) on parameters whose gradient the engine does not keep in ``.grad``.

At stages 2 and 3 (and at stages 0-1 where gradients are summed in another dtype than the
parameters') each rank holds only its shard of the gradient, outside ``.grad``: torch's clipping
would find no gradient there, return 0 and clip nothing, and the run would silently differ from
the torch run the script describes (issue 41 case 1). These functions are wrapped once an engine
exists, so that a call naming such a parameter stops by name on every rank that makes it (a script
clips on every rank), before any update, pointing to the config's ``gradient_clipping``, which
clips by the norm of the whole global-batch gradient at the step, as torch's call would.
Parameters whose ``.grad`` is the engine's (stages 0-1: the mean gradient, ``grads.py``) pass
through to torch unchanged.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Union

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from . import full_state


class ShardedGradientError(RuntimeError):
    """torch's gradient clipping was called on parameters whose gradient the engine keeps as shards
    across ranks, not in ``.grad``."""


_WRAPPED = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")
_installed = False


def _check(name: str, params: list) -> None:
    for p in params:
        found = full_state._locate(p)
        if found is not None and not found[0].grads.holds_param_grads:
            raise ShardedGradientError(
                f"torch.nn.utils.{name} was called on parameters trained by a zengine engine that "
                f"keeps their gradients as shards across ranks, not in .grad (ZeRO stage 2/3, or a "
                f"gradient accumulated in another dtype): it would find no gradient and clip "
                f'nothing. Set "gradient_clipping": <max_norm> in the config instead: the engine '
                f"clips by the norm of the whole gradient at each step, as this call would in torch."
            )


def _wrap(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def clip(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], *args, **kwargs):
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        _check(name, params)
        return original(params, *args, **kwargs)

    clip.__zengine_wraps__ = original
    return clip


def install() -> None:
    """Wrap torch's clipping functions (once per process; the wrappers pass unknown parameters through)."""
    global _installed
    if _installed:
        return
    _installed = True
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in _WRAPPED:
            original = getattr(module, name, None)
            if original is not None and not hasattr(original, "__zengine_wraps__"):
                setattr(module, name, _wrap(name, original))
