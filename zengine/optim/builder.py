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
``betas``, ... keeps it. The keys a type accepts are its constructor's keyword arguments (plus
DeepSpeed's Adam keys), each checked by one ``Rule`` (``params.py``); ``load_config`` applies the
same rules through ``optimizer_param_problems`` before any work starts. Every error names the key
path (``optimizer.params.<key>``) and, for a near miss, the key that was probably meant.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zengine.optim.params import ANY, FLAG, NUMBER, NUMBERS, Rule, param_problems

__all__ = ["Bf16Masters", "build_optimizer", "optimizer_param_problems", "OPTIMIZER_NAMES"]

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

# Ranges of the numeric keys, checked here so the message names the key; torch checks the rest.
# eps divides, so 0 is refused although torch accepts it.
_NUMBER_RULES: dict[str, Rule] = {
    "lr": Rule(NUMBER, minimum=0),
    "eps": Rule(NUMBER, minimum=0, above_minimum=True),
    "weight_decay": Rule(NUMBER, minimum=0),
    "momentum": Rule(NUMBER, minimum=0),
    "dampening": Rule(NUMBER, minimum=0),
    "lr_decay": Rule(NUMBER, minimum=0),
    "alpha": Rule(NUMBER, minimum=0),
    "initial_accumulator_value": Rule(NUMBER, minimum=0),
}
_BETAS = Rule(NUMBERS, length=2, minimum=0, below=1)

# Torch's tri-state implementation switches: true, false, or null for torch's own choice.
_OPTIONAL_FLAGS = ("foreach", "fused")

# Keys that belong elsewhere in the config, with where they go.
_MISPLACED = {
    "max_grad_norm": "is not an optimizer parameter; use the top-level 'gradient_clipping' key"
}

_FUSED_DEVICE_TYPES = ("cpu", "cuda")


def _torch_optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Lower-cased name -> class, for every concrete optimizer torch.optim exports."""
    classes = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if (
            isinstance(obj, type)
            and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer
        ):
            classes[name.lower()] = obj
    return classes


_TORCH_CLASSES = _torch_optimizer_classes()

OPTIMIZER_NAMES: tuple[str, ...] = ("Adam", "AdamW", "CPUAdam", "DeepSpeedCPUAdam") + tuple(
    sorted(cls.__name__ for key, cls in _TORCH_CLASSES.items() if key not in (_ADAM, _ADAMW))
)
"""The ``optimizer.type`` values build_optimizer accepts (matched case-insensitively)."""


@dataclass(frozen=True)
class Bf16Masters:
    """The optimizer steps low-precision masters (``bf16.bf16_master_weights_and_grads`` or
    ``fp16.fp16_master_weights_and_grads``, by ``dtype``): how."""

    fp32_states: bool  # Adam's moments in fp32 (bf16_optimizer_states false; always under fp16)
    rounding: str  # "nearest", "kahan" or "stochastic" (bf16.master_rounding)
    seed: int = 0  # stochastic rounding's keys (one per rank)
    dtype: torch.dtype = torch.bfloat16  # the masters'

    def refusal(self, optimizer: str) -> str | None:
        """Why ``optimizer`` (not zengine's Adam on the bf16 kernel) cannot honour this, or None:
        it keeps its states in the parameters' dtype and rounds to nearest."""
        if self.dtype == torch.float16:
            return (
                f"fp16.fp16_master_weights_and_grads: {optimizer} keeps its states in the "
                "parameters' dtype (fp16); fp16 masters step with fp32 moments, as DeepSpeed's CPU "
                "Adam does: use optimizer type Adam/AdamW/CPUAdam from the config (or "
                "zengine.ops.CPUAdam), or remove the key"
            )
        if self.fp32_states:
            return (
                f"bf16.bf16_master_weights_and_grads without bf16_optimizer_states: {optimizer} keeps "
                "its states in the parameters' dtype (bf16); fp32 moments over bf16 masters need "
                "optimizer type Adam/AdamW/CPUAdam from the config, or set bf16_optimizer_states"
            )
        if self.rounding != "nearest":
            return (
                f"bf16.master_rounding: {self.rounding!r} needs optimizer type Adam/AdamW/CPUAdam "
                f"from the config (zengine's bf16 Adam kernel); {optimizer} rounds its own updates "
                "to nearest; leave master_rounding \"nearest\""
            )
        return None


def build_optimizer(
    type_name: str,
    params: dict | None,
    param_groups: Iterable[dict] | Iterable[torch.Tensor],
    *,
    cpu_offload: bool = False,
    bf16_masters: Bf16Masters | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer the config names, over ``param_groups``.

    Args:
        type_name: ``optimizer.type``, matched case-insensitively.
        params: ``optimizer.params``; defaults for every group.
        param_groups: param-group dicts (each with ``"params"``), or plain tensors for one group.
            The dicts are copied, not modified; their own hyper-parameters win over ``params``.
        cpu_offload: the optimizer steps CPU master shards (``offload_optimizer.device: cpu``);
            as in DeepSpeed, Adam and AdamW then use the CPUAdam kernel when it is available.
        bf16_masters: the shards are bf16 masters; Adam and AdamW then step on zengine's bf16
            kernel (CPUAdam, on any device), other types keep their states in bf16.

    Raises:
        ValueError: an unknown type, or an unknown, mistyped or out-of-range parameter; the
            message names ``optimizer.type`` or ``optimizer.params.<key>``.
    """
    name = _checked_type(type_name)
    display, rules = _param_rules(name)
    params = dict(params or {})
    problems = _problems(name, display, rules, params)
    if problems:
        raise ValueError("\n".join(f"optimizer.params.{key} {text}" for key, text in problems))
    kwargs = {key: rules[key].parse(value) for key, value in params.items()}
    groups = _copy_groups(param_groups)
    if bf16_masters is not None and _is_adam(name) and not kwargs.get("torch_adam", False):
        return _build_bf16_adam(name, kwargs, groups, bf16_masters)
    problem = bf16_masters.refusal(f"optimizer type {type_name}") if bf16_masters else None
    if problem:
        raise ValueError(problem)
    if _is_adam(name):
        return _build_adam(name, kwargs, groups, cpu_offload, given=params)
    return _construct(_TORCH_CLASSES[name], groups, kwargs)


def optimizer_param_problems(type_name: str, params: dict) -> list[tuple[str, str]]:
    """Every problem build_optimizer would find in ``params`` for the optimizer ``type_name``,
    as ``(key, text)`` pairs (see ``params.py``), found without building anything.

    Raises:
        ValueError: ``type_name`` is not an optimizer build_optimizer knows.
    """
    name = _checked_type(type_name)
    return _problems(name, *_param_rules(name), params)


def _problems(
    name: str, display: str, rules: dict[str, Rule], params: dict
) -> list[tuple[str, str]]:
    problems = [(key, _MISPLACED[key]) for key in params if key in _MISPLACED]
    rest = {key: value for key, value in params.items() if key not in _MISPLACED}
    problems += param_problems(rest, rules, f"the {display} optimizer")
    if _is_adam(name):
        problems += _adam_problems(params)
    return problems


def _checked_type(type_name: Any) -> str:
    """The lower-cased name of an optimizer build_optimizer knows; raises ValueError for others."""
    if not isinstance(type_name, str):
        raise ValueError(f"optimizer.type must be a string, got {type_name!r}")
    name = type_name.lower()
    if name in _DEEPSPEED_ONLY:
        raise ValueError(
            f"optimizer.type {type_name!r}: DeepSpeed's {_DEEPSPEED_ONLY[name]} optimizer is not "
            f"available in zengine; supported: {', '.join(OPTIMIZER_NAMES)}"
        )
    if not _is_adam(name) and name not in _TORCH_CLASSES:
        raise ValueError(_unknown_type_message(type_name))
    return name


def _is_adam(name: str) -> bool:
    return name in (_ADAM, _ADAMW) or name in _CPU_ADAM_NAMES


def _param_rules(name: str) -> tuple[str, dict[str, Rule]]:
    """``(display name, {key: rule})`` for a known lower-cased optimizer name: the keyword
    arguments of its torch constructor (for the Adam family, torch's Adam plus DeepSpeed's keys),
    each with the rule its default and name imply."""
    if _is_adam(name):
        defaults = _constructor_defaults(torch.optim.Adam)
        for key in _HIDDEN_TORCH_ADAM_KEYS:
            defaults.pop(key, None)
        defaults.update(_DEEPSPEED_ADAM_KEYS)
        display = {_ADAM: "Adam", _ADAMW: "AdamW"}.get(name, "CPUAdam")
    else:
        cls = _TORCH_CLASSES[name]
        defaults, display = _constructor_defaults(cls), cls.__name__
    return display, {key: _rule_for(key, default) for key, default in defaults.items()}


def _rule_for(key: str, default: Any) -> Rule:
    """The rule of one keyword argument, from its name and the type of its default."""
    if key in _OPTIONAL_FLAGS:
        return Rule(FLAG, nullable=True)
    if isinstance(default, bool):
        return Rule(FLAG)
    if key == "betas":
        return _BETAS
    if isinstance(default, tuple):
        # An entry whose default is None (Adafactor's eps) may stay None.
        return Rule(
            NUMBERS,
            length=len(default),
            null_entries=tuple(i for i, d in enumerate(default) if d is None),
        )
    if isinstance(default, (int, float)) or key == "lr":
        return _NUMBER_RULES.get(key, Rule(NUMBER))
    return Rule(ANY)


def _adam_problems(params: dict) -> list[tuple[str, str]]:
    """Problems of DeepSpeed's Adam keys that no single-key rule sees."""
    problems = []
    modes = [
        params[key] for key in ("adam_w_mode", "adamw_mode") if isinstance(params.get(key), bool)
    ]
    if len(set(modes)) > 1:
        problems.append(
            (
                "adam_w_mode",
                "disagrees with adamw_mode (CPUAdam's spelling of the same switch); "
                "give one of them",
            )
        )
    if params.get("fp32_optimizer_states") is False:
        problems.append(
            ("fp32_optimizer_states", "must be true: only fp32 optimizer states are supported")
        )
    return problems


def _build_adam(
    name: str, kwargs: dict, groups: list[dict], cpu_offload: bool, given: dict
) -> torch.optim.Optimizer:
    """``kwargs``: the checked params; ``given``: the params as written, to tell a key the
    config set from a default."""
    torch_adam = kwargs.pop("torch_adam", False)
    decoupled = _adam_w_mode(kwargs) or name == _ADAMW  # DeepSpeed: type AdamW is always decoupled
    bias_correction = kwargs.pop("bias_correction", True)
    kwargs.pop("set_grad_none", None)
    kwargs.pop("fp32_optimizer_states", None)  # only true passes optimizer_param_problems

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
        if not kwargs.pop("fused", False) or "fused" in given:
            raise
        return _construct(cls, groups, kwargs)


def _build_bf16_adam(name: str, kwargs: dict, groups: list[dict], masters: Bf16Masters):
    """Adam/AdamW over bf16 masters: CPUAdam on the bf16 kernel (its torch fallback off the
    CPU), the arithmetic fp32 per element, as DeepSpeed's fused and CPU Adam do."""
    from zengine.ops import CPUAdam  # (ops/ builds nothing on import)

    decoupled = _adam_w_mode(kwargs) or name == _ADAMW
    bias_correction = kwargs.pop("bias_correction", True)
    for key in ("torch_adam", "set_grad_none", "fp32_optimizer_states"):
        kwargs.pop(key, None)
    extra = dict(
        fp32_optimizer_states=masters.fp32_states, rounding=masters.rounding, seed=masters.seed
    )
    kwargs.update(extra)
    return _build_cpu_adam(CPUAdam, groups, kwargs, decoupled, bias_correction)


def _adam_w_mode(kwargs: dict) -> bool:
    """Read ``adam_w_mode`` (or CPUAdam's spelling ``adamw_mode``); optimizer_param_problems
    has already refused the two disagreeing."""
    modes = [kwargs.pop(key) for key in ("adam_w_mode", "adamw_mode") if key in kwargs]
    return modes[0] if modes else True


def _build_cpu_adam(
    kernel: type, groups: list[dict], kwargs: dict, decoupled: bool, bias_correction: bool
):
    for key in _TORCH_ONLY_ADAM_KEYS:
        if kwargs.pop(key, None):
            raise ValueError(
                f"optimizer.params.{key} is a torch option that the CPUAdam kernel does not have"
            )
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
        isinstance(p, torch.Tensor)
        and torch.is_floating_point(p)
        and p.device.type in _FUSED_DEVICE_TYPES
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
        if name not in ("self", "params")
        and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
    }


def _construct(cls: type, groups: list[dict], kwargs: dict) -> torch.optim.Optimizer:
    try:
        return cls(groups, **kwargs)
    except ValueError as err:
        raise ValueError(f"optimizer.params ({cls.__name__}): {err}") from None


def _unknown_type_message(type_name: str) -> str:
    message = f"optimizer.type {type_name!r} is not a known optimizer"
    lowered = {name.lower(): name for name in OPTIMIZER_NAMES}
    close = difflib.get_close_matches(type_name.lower(), list(lowered), n=1)
    if close:
        message += f"; did you mean {lowered[close[0]]!r}?"
    return message + f" (supported: {', '.join(OPTIMIZER_NAMES)})"
