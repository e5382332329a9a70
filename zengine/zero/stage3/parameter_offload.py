"""``optimizer.parameter_offload``: the members of DeepSpeed's stage-3 ``DeepSpeedZeRoOffload`` that
libraries drive from outside the engine.

TRL's ``unwrap_model_for_generation`` (GRPO, RLOO, online DPO, GKD at ZeRO-3, with
``ds3_gather_for_generation``) gathers every parameter, then takes the stage-3 hooks off the model
so that ``generate`` runs as plain torch on the whole parameters: it clears each parameter's
``ds_active_sub_modules`` (walking ``named_parameters`` and ``ds_external_parameters()``), calls
``remove()`` on every handle in ``forward_hooks`` and ``backward_hooks`` and empties both lists.
Afterwards it invalidates the trace through ``param_coordinator`` and hooks the model again with
``_register_deepspeed_module(module)``.

Here the handles are the module hooks' own (``hooks.ModuleHooks``: the units' forward hooks, the
trainable parameters' gradient hooks), so removing them takes them off for real, and registering
the root module again replaces whatever is left instead of doubling it. The coordinator is the
fetcher's ``Trace``: invalidating it drops the recorded order, finishes gathers in flight, and the
next training step records the order again (the generation's forwards are never recorded).
"""

from __future__ import annotations

from torch import nn

from . import external
from .fetcher import Fetcher
from .hooks import ModuleHooks


class TraceCoordinator:
    """DeepSpeed's ``param_coordinator`` as its callers use it, over the fetcher's trace."""

    def __init__(self, fetcher: Fetcher):
        self.fetcher = fetcher

    def is_record_trace(self) -> bool:
        """No order recorded yet: the next training step records it."""
        return self.fetcher.trace.units is None and not self.fetcher.trace.invalid

    def is_complete_trace(self) -> bool:
        """An order is recorded: training steps gather ahead by it."""
        return self.fetcher.trace.units is not None

    def is_invalid_trace(self) -> bool:
        """The order was dropped (``_invalidate_trace``) and not recorded again yet."""
        return self.fetcher.trace.invalid

    def _invalidate_trace(self) -> None:
        """Drop the recorded order and finish the gathers in flight (DeepSpeed's semantics: an
        already invalid trace cannot be invalidated again)."""
        if self.is_invalid_trace():
            raise RuntimeError("attempted to invalidate already invalid trace")
        self.fetcher.drain()
        self.fetcher.trace.invalidate()


class ParameterOffload:
    """``Stage3Optimizer.parameter_offload``: the model, its hook handles, the trace (see the module
    doc). Gives every module of the model DeepSpeed's ``ds_external_parameters()``."""

    def __init__(self, module: nn.Module, hooks: ModuleHooks, fetcher: Fetcher):
        self.module = module
        self.hooks = hooks
        self.param_coordinator = TraceCoordinator(fetcher)
        for m in module.modules():
            external.install_lookup(m)

    def get_param_coordinator(self) -> TraceCoordinator:
        """DeepSpeed's accessor of ``param_coordinator``."""
        return self.param_coordinator

    @property
    def forward_hooks(self) -> list:
        """The handles of the units' pre- and post-forward hooks."""
        return self.hooks.forward_handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:
        self.hooks.forward_handles = list(handles)

    @property
    def backward_hooks(self) -> list:
        """The handles of the hooks that serve backward (each trainable parameter's gradient hook;
        the gathers before a module's backward hang off its post-forward hook)."""
        return self.hooks.backward_handles

    @backward_hooks.setter
    def backward_hooks(self, handles: list) -> None:
        self.hooks.backward_handles = list(handles)

    def _register_deepspeed_module(self, module: nn.Module, count=None) -> None:
        """Hook the model again (DeepSpeed registers the hooks of ``module``'s subtree; its callers
        pass the root). The trace is invalidated first, as DeepSpeed does, when it is not already."""
        if module is not self.module:
            raise ValueError(
                "parameter_offload._register_deepspeed_module: zengine re-registers the hooks of the "
                "engine's whole model only; pass optimizer.parameter_offload.module"
            )
        if not self.param_coordinator.is_invalid_trace():
            self.param_coordinator._invalidate_trace()
        for m in module.modules():
            external.install_lookup(m)
        self.hooks.reinstall()

    def _remove_module_hooks(self) -> None:
        """Take every stage-3 hook off the model (DeepSpeed's ``destroy`` path)."""
        self.hooks.remove()

    def destroy(self) -> None:
        """Take every stage-3 hook off the model."""
        self._remove_module_hooks()
