"""Stage-3 leaf modules (DeepSpeed's "z3 leaf modules"): modules that gather their whole subtree at once.

Stage 3 gathers each module's parameters when the module runs, and ranks gather in step: one
collective per module, matched by order. A module whose children run by data (a mixture-of-experts
layer routing each rank's tokens to other experts, an early exit) would make ranks gather different
parameters at the same point. Marked as a leaf, the module gathers every parameter of its subtree
when it starts and releases them when it ends, whichever children run, so every rank gathers the
same. Costs the memory of the whole subtree while it runs.

Leaves are marked by ``set_z3_leaf_modules(model, classes)`` (DeepSpeed's function, also in
``zengine.utils``) before ``initialize``, or by the config's ``zero_optimization.leaf_module``
(``classes`` by bare or qualified name, exact ``names``, ``name_suffixes``). The marks are kept
here, not on the modules.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterable, Sequence, Union

from torch import nn

if TYPE_CHECKING:  # annotations only
    from ...config.zero import LeafModuleConfig

_leaves: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _class_matches(module: nn.Module, wanted: Sequence[Union[type, str]]) -> bool:
    cls = type(module)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    return any(
        cls is w if isinstance(w, type) else w in (cls.__name__, cls.__qualname__, qualified)
        for w in wanted
    )


def _mark(
    model: nn.Module, leaf_module_classes: Iterable[Union[type, str]], leaf: bool
) -> list[nn.Module]:
    wanted = list(leaf_module_classes)
    bad = [w for w in wanted if not isinstance(w, (type, str))]
    if bad:
        raise TypeError(
            f"set_z3_leaf_modules: expected module classes (or class names), got {bad!r}"
        )
    found = [m for m in model.modules() if _class_matches(m, wanted)]
    if not found:
        raise ValueError(f"set_z3_leaf_modules: no module of the classes {wanted!r} in the model")
    for m in found:
        (_leaves.add if leaf else _leaves.discard)(m)
    return found


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Iterable[Union[type, str]]
) -> list[nn.Module]:
    """Mark every module of ``model`` whose class is one of ``leaf_module_classes`` (classes, or their names)
    as a stage-3 leaf; returns them. Raises ValueError when there is none. Call it before ``initialize``."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Iterable[Union[type, str]]
) -> list[nn.Module]:
    """Remove the leaf mark from the modules of those classes; returns them."""
    return _mark(model, leaf_module_classes, False)


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is marked as a stage-3 leaf."""
    return module in _leaves


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked as stage-3 leaves."""
    return [m for m in model.modules() if m in _leaves]


def mark_from_config(model: nn.Module, leaf_cfg: LeafModuleConfig) -> None:
    """Mark the leaves the config's ``zero_optimization.leaf_module`` section names (a class it lists that
    the model does not have is no error: the defaults list Hugging Face's mixture-of-experts blocks)."""
    for name, m in model.named_modules():
        if (
            _class_matches(m, leaf_cfg.classes)
            or name in leaf_cfg.names
            or any(name == s or name.endswith("." + s) for s in leaf_cfg.name_suffixes)
        ):
            _leaves.add(m)
