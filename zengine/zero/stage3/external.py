"""Parameters a module uses in its forward without owning them (DeepSpeed's "external parameters").

``register_external_parameter(module, param)`` tells stage 3 that ``module``'s forward reads
``param`` (a tied weight read by another layer): the module hooks then gather it with the module's
own parameters and release it after. zengine also gathers such a parameter without being told (the
external-use mode of ``hooks.py``), so a registration changes when it is gathered, not whether.

The registrations live in a table of ours, keyed weakly by module. DeepSpeed's callers read them
through a method on each module, ``module.ds_external_parameters()`` (``(id, parameter)`` pairs:
TRL's ``unwrap_model_for_generation`` walks them beside ``named_parameters``), which
``install_lookup`` binds on every module of an engine's model and on a module given a
registration.
"""

from __future__ import annotations

import types
import weakref
from typing import Iterable

from torch import nn

# module -> {id(parameter): parameter}, in registration order; goes with the module
_registered: "weakref.WeakKeyDictionary[nn.Module, dict[int, nn.Parameter]]" = (
    weakref.WeakKeyDictionary()
)


def _ds_external_parameters(module: nn.Module) -> Iterable[tuple[int, nn.Parameter]]:
    """DeepSpeed's ``module.ds_external_parameters()``: the ``(id, parameter)`` pairs registered."""
    return list(_registered.get(module, {}).items())


def install_lookup(module: nn.Module) -> None:
    """Give ``module`` DeepSpeed's ``ds_external_parameters()`` method (reading our table), as
    DeepSpeed gives it to every module of a stage-3 model."""
    if "ds_external_parameters" not in vars(module):
        # (a bound method: torch's deepcopy of the module rebinds it to the copy)
        module.ds_external_parameters = types.MethodType(_ds_external_parameters, module)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` for ``module``'s forward as one of its own (DeepSpeed's function of the
    same name). Hooks installed later see it; the engine's hooks installed earlier pick it up when
    re-registered (``optimizer.parameter_offload._register_deepspeed_module``); either way zengine
    gathers a parameter read outside its module."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("register_external_parameter: the parameter is not a torch.nn.Parameter")
    install_lookup(module)
    _registered.setdefault(module, {})[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo ``register_external_parameter`` (DeepSpeed's function of the same name)."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError(
            "unregister_external_parameter: the parameter is not a torch.nn.Parameter"
        )
    own = _registered.get(module, {})
    if id(parameter) not in own:
        raise RuntimeError(
            "unregister_external_parameter: the parameter is not a registered external parameter "
            "of the module"
        )
    del own[id(parameter)]


def registered(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered as external to ``module``, in registration order."""
    return list(_registered.get(module, {}).values())
