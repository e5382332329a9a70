"""Build the optimizer named by the config's ``optimizer`` section, with DeepSpeed's meanings.

``{"type": NAME, "params": {...}}`` is read the way DeepSpeed reads it:

- ``Adam`` steps with decoupled weight decay (AdamW) unless ``"adam_w_mode": false``, which
  gives classic L2 Adam. ``AdamW`` is always decoupled. DeepSpeed runs both on its fused
  kernel, whose ``weight_decay`` defaults to 0 (torch's AdamW defaults to 0.01).
  ``"torch_adam": true`` asks for torch's own class with torch's defaults, as DeepSpeed does.
- ``CPUAdam`` / ``DeepSpeedCPUAdam`` is the SIMD CPU kernel from ``zengine.ops`` when that
  package is present; until then, the same update from torch.
- Any other name is a ``torch.optim`` class (case-insensitive): ``SGD``, ``Adagrad``,
  ``RMSprop``, ... taking that class's own keyword arguments.

The config's params are defaults: a param group that carries its own ``lr``, ``weight_decay``,
``betas``, ... keeps it. Every error names the key path (``optimizer.params.<key>``) and, for a
near miss, the key that was probably meant.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["build_optimizer", "OPTIMIZER_NAMES"]

# Adam spellings handled here rather than by name lookup in torch.optim.
_ADAM = "adam"
_ADAMW = "adamw"
_CPU_ADAM_NAMES = ("cpuadam", "deepspeedcpuadam")

# DeepSpeed optimizers with no zengine counterpart: named in the error, never guessed at.
_DEEPSPEED_ONLY = {
    "lamb": "Lamb",
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
    "lion": "Lion",
}

# Keys DeepSpeed's Adam variants read beyond torch's constructor arguments, with defaults.
_DEEPSPEED_ADAM_KEYS: dict[str, Any] = {
    "bias_correction": True,
    "adam_w_mode": True,
    "adamw_mode": True,  # the CPUAdam constructor's spelling of adam_w_mode
    "torch_adam": False,
    "set_grad_none": True,  # a zero_grad() policy; the engine always sets grads to None
    "fp32_optimizer_states": True,
}

# Torch keyword arguments that collide with DeepSpeed's own keys for the same idea.
_HIDDEN_TORCH_ADAM_KEYS = ("decoupled_weight_decay",)

# Torch implementation options that CPUAdam has no counterpart for.
_TORCH_ONLY_ADAM_KEYS = ("foreach", "maximize", "capturable", "differentiable", "fused")

# Lower bounds checked here so the message names the key; torch checks the rest.
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "alpha")

# Torch's tri-state implementation switches: true, false, or null for torch's own choice.
_OPTIONAL_FLAGS = ("foreach", "fused")

_FUSED_DEVICE_TYPES = ("cpu", "cuda")


def _torch_optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Lower-cased name -> class, for every concrete optimizer torch.optim exports."""
    classes = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            classes[name.lower()] = obj
    return classes


_TORCH_CLASSES = _torch_optimizer_classes()

OPTIMIZER_NAMES: tuple[str, ...] = ("Adam", "AdamW", "CPUAdam", "DeepSpeedCPUAdam") + tuple(
    sorted(cls.__name__ for key, cls in _TORCH_CLASSES.items() if key not in (_ADAM, _ADAMW))
)
"""The ``optimizer.type`` values build_optimizer accepts (matched case-insensitively)."""


def build_optimizer(
    type_name: str,
    params: dict | None,
    param_groups: Iterable[dict] | Iterable[torch.Tensor],
    *,
    cpu_offload: bool = False,
) -> torch.optim.Optimizer:
    """Build the optimizer the config names, over ``param_groups``.

    Args:
        type_name: ``optimizer.type``, matched case-insensitively.
        params: ``optimizer.params``; defaults for every group.
        param_groups: param-group dicts (each with ``"params"``), or plain tensors for one group.
            The dicts are copied, not modified; their own hyper-parameters win over ``params``.
        cpu_offload: the optimizer steps CPU master shards (``offload_optimizer.device: cpu``);
            as in DeepSpeed, Adam and AdamW then use the CPUAdam kernel when it is available.

    Raises:
        ValueError: an unknown type, or an unknown, mistyped or out-of-range parameter; the
            message names ``optimizer.type`` or ``optimizer.params.<key>``.
    """
    if not isinstance(type_name, str):
        raise ValueError(f"optimizer.type must be a string, got {type_name!r}")
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise ValueError(
            "optimizer.params.max_grad_norm is not an optimizer parameter; "
            "use the top-level 'gradient_clipping' key"
        )
    groups = _copy_groups(param_groups)
    name = type_name.lower()
    if name in (_ADAM, _ADAMW) or name in _CPU_ADAM_NAMES:
        return _build_adam(name, params, groups, cpu_offload)
    if name in _DEEPSPEED_ONLY:
        raise ValueError(
            f"optimizer.type {type_name!r}: DeepSpeed's {_DEEPSPEED_ONLY[name]} optimizer is not "
            f"available in zengine; supported: {', '.join(OPTIMIZER_NAMES)}"
        )
    if name not in _TORCH_CLASSES:
        raise ValueError(_unknown_type_message(type_name))
    cls = _TORCH_CLASSES[name]
    kwargs = _check_params(cls.__name__, params, _constructor_defaults(cls))
    return _construct(cls, groups, kwargs)


def _build_adam(name: str, params: dict, groups: list[dict], cpu_offload: bool) -> torch.optim.Optimizer:
    torch_defaults = _constructor_defaults(torch.optim.Adam)
    for key in _HIDDEN_TORCH_ADAM_KEYS:
        torch_defaults.pop(key, None)
    display = {_ADAM: "Adam", _ADAMW: "AdamW"}.get(name, "CPUAdam")
    kwargs = _check_params(display, params, {**torch_defaults, **_DEEPSPEED_ADAM_KEYS})

    torch_adam = kwargs.pop("torch_adam", False)
    decoupled = _adam_w_mode(kwargs) or name == _ADAMW  # DeepSpeed: type AdamW is always decoupled
    bias_correction = kwargs.pop("bias_correction", True)
    kwargs.pop("set_grad_none", None)
    if not kwargs.pop("fp32_optimizer_states", True):
        raise ValueError("optimizer.params.fp32_optimizer_states: only true (fp32 optimizer states) is supported")

    wants_kernel = (name in _CPU_ADAM_NAMES or cpu_offload) and not torch_adam
    if wants_kernel or not bias_correction:
        kernel = None if torch_adam else _compiled_cpu_adam()
        if kernel is not None and _all_on_cpu(groups):
            return _build_cpu_adam(kernel, groups, kwargs, decoupled, bias_correction)
        if not bias_correction:
            raise ValueError(
                "optimizer.params.bias_correction: false needs zengine's CPUAdam kernel "
                "(zengine.ops) with CPU parameters; torch's Adam always applies bias correction"
            )

    if not torch_adam:
        # DeepSpeed's fused and CPU Adam kernels default weight_decay to 0 for both modes.
        kwargs.setdefault("weight_decay", 0.0)
        if _may_fuse(kwargs, groups):
            # torch's fused kernel is several times faster than the default foreach path on CPU.
            kwargs["fused"] = True
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    try:
        return _construct(cls, groups, kwargs)
    except RuntimeError:
        if not kwargs.pop("fused", False) or "fused" in params:
            raise
        return _construct(cls, groups, kwargs)


def _adam_w_mode(kwargs: dict) -> bool:
    """Read ``adam_w_mode`` (or CPUAdam's spelling ``adamw_mode``); both given must agree."""
    modes = {key: kwargs.pop(key) for key in ("adam_w_mode", "adamw_mode") if key in kwargs}
    if len(set(modes.values())) > 1:
        raise ValueError("optimizer.params.adam_w_mode and optimizer.params.adamw_mode disagree; give one of them")
    return next(iter(modes.values()), True)


def _build_cpu_adam(kernel: type, groups: list[dict], kwargs: dict, decoupled: bool, bias_correction: bool):
    for key in _TORCH_ONLY_ADAM_KEYS:
        if kwargs.pop(key, None):
            raise ValueError(f"optimizer.params.{key} is a torch option that the CPUAdam kernel does not have")
    if kwargs.pop("amsgrad", False):
        raise ValueError("optimizer.params.amsgrad: the CPUAdam kernel does not implement AMSGrad")
    kwargs.setdefault("weight_decay", 0.0)
    try:
        return kernel(groups, adamw_mode=decoupled, bias_correction=bias_correction, **kwargs)
    except ValueError as err:
        raise ValueError(f"optimizer.params: {err}") from None


def _compiled_cpu_adam() -> type | None:
    """``zengine.ops.CPUAdam`` when the ops package is installed, else None.

    The compiled SIMD kernel ships with the ops package; without it the torch implementation
    of the same update is used.
    """
    try:
        from zengine.ops import CPUAdam
    except ImportError:
        return None
    return CPUAdam


def _may_fuse(kwargs: dict, groups: list[dict]) -> bool:
    """True when torch's fused Adam applies: not turned off, no conflicting option, and every
    parameter a floating tensor on a device the fused kernels cover."""
    if "fused" in kwargs or kwargs.get("foreach") or kwargs.get("differentiable"):
        return False
    tensors = [p for group in groups for p in group["params"]]
    return bool(tensors) and all(
        isinstance(p, torch.Tensor) and torch.is_floating_point(p) and p.device.type in _FUSED_DEVICE_TYPES
        for p in tensors
    )


def _all_on_cpu(groups: list[dict]) -> bool:
    return all(p.device.type == "cpu" for group in groups for p in group["params"])


def _copy_groups(param_groups) -> list[dict]:
    """Shallow-copy the groups so the caller's dicts are untouched; a list of tensors is one group."""
    items = list(param_groups)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if all(isinstance(item, torch.Tensor) for item in items):
        return [{"params": items}]
    groups = []
    for item in items:
        if not isinstance(item, dict) or "params" not in item:
            raise ValueError("each param group must be a dict with a 'params' entry")
        group = dict(item)
        tensors = group["params"]
        group["params"] = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    return groups


def _constructor_defaults(cls: type) -> dict[str, Any]:
    """Keyword arguments of ``cls.__init__`` (beyond ``params``) with their defaults."""
    signature = inspect.signature(cls.__init__)
    return {
        name: (None if param.default is inspect.Parameter.empty else param.default)
        for name, param in signature.parameters.items()
        if name not in ("self", "params") and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
    }


def _check_params(display: str, params: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """Check ``params`` against the known keys; the type each key takes follows its default."""
    checked = {}
    for key, value in params.items():
        if key not in defaults:
            raise ValueError(_unknown_key_message(f"optimizer.params.{key}", key, defaults, display))
        checked[key] = _check_value(f"optimizer.params.{key}", value, defaults[key])
    return checked


def _check_value(path: str, value: Any, default: Any) -> Any:
    key = path.rsplit(".", 1)[-1]
    if key in _OPTIONAL_FLAGS and value is None:
        return value
    if isinstance(default, bool) or key in _OPTIONAL_FLAGS:
        if not isinstance(value, bool):
            raise ValueError(f"{path} must be true or false, got {value!r}")
        return value
    if isinstance(default, tuple):
        # An entry whose default is None (Adafactor's eps) may stay None.
        if (
            not isinstance(value, (list, tuple))
            or len(value) != len(default)
            or not all(_is_number(v) or (v is None and d is None) for v, d in zip(value, default))
        ):
            raise ValueError(f"{path} must be a list of {len(default)} numbers, got {value!r}")
        if key == "betas" and not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError(f"{path} must lie in [0, 1), got {value!r}")
        return tuple(None if v is None else float(v) for v in value)
    if isinstance(default, (int, float)) or path.endswith(".lr"):
        if not _is_number(value):
            raise ValueError(f"{path} must be a number, got {value!r}")
        if key in _NON_NEGATIVE and value < 0:
            raise ValueError(f"{path} must be >= 0, got {value!r}")
        return value
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _construct(cls: type, groups: list[dict], kwargs: dict) -> torch.optim.Optimizer:
    try:
        return cls(groups, **kwargs)
    except ValueError as err:
        raise ValueError(f"optimizer.params ({cls.__name__}): {err}") from None


def _unknown_key_message(path: str, key: str, known: Iterable[str], display: str) -> str:
    message = f"{path} is not a parameter of the {display} optimizer"
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return message + f" (known: {', '.join(sorted(known))})"


def _unknown_type_message(type_name: str) -> str:
    message = f"optimizer.type {type_name!r} is not a known optimizer"
    lowered = {name.lower(): name for name in OPTIMIZER_NAMES}
    close = difflib.get_close_matches(type_name.lower(), list(lowered), n=1)
    if close:
        message += f"; did you mean {lowered[close[0]]!r}?"
    return message + f" (supported: {', '.join(OPTIMIZER_NAMES)})"
