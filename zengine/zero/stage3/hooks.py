"""Module hooks that fetch a module's parameters before it runs and release them after.

Forward: a pre-hook gathers the module's own parameters (not its
children's); a post-hook releases them and, when autograd is recording,
hooks the outputs so that the same parameters are gathered again just
before the module's backward. A parameter's full data is freed again as
soon as its gradient is done (``grads.py``), frozen ones at the end of
backward.

A leaf module (``leaf.py``) is one unit with its whole subtree: its hooks gather every parameter below
it, and its descendants get none.

Parameters used outside their module (``F.linear(x, self.emb.weight)``) are
caught by a torch-function mode that is active during the engine's forward
(and, entered by the root module's own hooks, during a call of the model
outside the engine: TRL generating through the hooks): an op that receives a
sharded parameter gathers it first, the running module releases it when it
finishes, and the op's outputs are hooked to gather it again for backward. A
parameter registered as external to a module (``external.py``) is gathered
with that module's own instead.

The hooks can be taken off and put back (``remove``, ``reinstall``): DeepSpeed's
callers do it through ``optimizer.parameter_offload`` (``parameter_offload.py``).

A gradient reaches a trainable parameter's accumulator only whole: autograd checks it against the
parameter's shape there. One that arrives while the parameter is sharded gathers it first
(``gather_before_gradient``): an op read the parameter where no hook saw it, such as TRL's fused
loss, which reads ``lm_head.weight`` inside an ``autograd.Function`` under ``GatheredParameters``
and releases it again before its backward returns the gradient. DeepSpeed keeps such a parameter
gathered through the backward of the module whose forward read it (an "external parameter"); the
gradient hook releases ours once its gradient is reduced.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ...distributed import diagnose
from . import external
from .fetcher import Fetcher
from .leaf import z3_leaf_module
from .param import ParamState, ShardedParam, lookup


def _tensors(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if torch.is_tensor(t) and t.requires_grad]


def _not_a_view(out: Any, params: list[ShardedParam]) -> Any:
    """``out`` with every tensor that is a view of one of ``params`` (``weight[:n]``, ``weight.t()``) replaced by
    a copy: the parameter is released after the op, and a view would outlive it, reading freed storage."""
    storages = {sp.full.untyped_storage().data_ptr() for sp in params}

    def own(t: Any) -> Any:
        return t.clone() if torch.is_tensor(t) and t.untyped_storage().data_ptr() in storages else t

    return tree_map(own, out)


class ModuleHooks:
    """Fetch/release hooks on every module that owns parameters, plus the external-use mode."""

    def __init__(self, module: nn.Module, fetcher: Fetcher):
        self.module = module
        self.fetcher = fetcher
        self.units: dict[nn.Module, list[ShardedParam]] = {}
        self.names: dict[nn.Module, str] = {}
        # externals fetched while each running module runs
        self.frames: list[list[ShardedParam]] = []
        self.running: list[set[int]] = []  # ids of the parameters of each running module
        self.enabled = True
        # compiled autograd: torch.compiler.disable
        self.wrap: Callable[[Callable], Callable] = lambda fn: fn
        self.internal = False  # our own tensor work inside hooks is not an external use
        self.backward_count = (
            0  # backwards finished so far (end_backward); a retained graph runs again
        )
        # what DeepSpeed calls the forward and backward hooks (parameter_offload.py hands them out)
        self.forward_handles: list = []  # each unit's pre- and post-forward hooks
        self.backward_handles: list = []  # the trainable parameters' gradient hooks
        self._trainable: list[ShardedParam] = []
        self.modes_active = 0  # external-use modes entered (the engine's forward enters one)
        self._outside: list[Optional[ExternalParamMode]] = []  # entered by the root's own hooks
        # forwards of the whole model, [with gradients, without]: a failed collective compares
        # them across ranks (diagnose.uneven_forwards: a rank that stopped generating early)
        self.forwards = [0, 0]
        me = weakref.ref(self)  # the registry must not keep an old engine alive
        diagnose.track_forwards(lambda: me().forwards if me() is not None else [])
        # (not one of DeepSpeed's forward hooks: it stays while TRL takes those off to generate)
        self._count_handle = self.module.register_forward_pre_hook(self._count_forward)
        self.install_forward()

    def install_forward(self) -> None:
        """Find the units (each module's own parameters, a leaf's whole subtree, and the parameters
        registered as external to it: ``external.py``) and hook each one's forward."""
        self.units, self.names = {}, {}
        inside_leaf: list[str] = []  # the leaves met so far: their descendants get no hooks
        for name, m in self.module.named_modules():
            if any(name.startswith(leaf + ".") for leaf in inside_leaf):
                continue
            if z3_leaf_module(m):  # the whole subtree is one unit (leaf.py)
                inside_leaf.append(name)
                owned = list(m.parameters())
            else:
                owned = [p for p in m._parameters.values() if p is not None]
            params = dict.fromkeys(owned + external.registered(m))
            unit = [sp for p in params if (sp := lookup(p)) is not None]
            if not unit:
                continue
            self.units[m] = unit
            self.names[m] = name or "<root>"
            self.forward_handles.append(m.register_forward_pre_hook(self._pre_forward))
            self.forward_handles.append(m.register_forward_hook(self._post_forward))
        # the model called directly (engine.module(x), generate): the external-use mode as well
        root = self.module
        self.forward_handles.append(root.register_forward_pre_hook(self._enter_outside))
        self.forward_handles.append(
            root.register_forward_hook(self._leave_outside, always_call=True)
        )

    def _enter_outside(self, m: nn.Module, args) -> None:
        """The root's forward outside the engine's: gather parameters read outside their module,
        as the engine's forward does (one mode; inside the engine's forward nothing to add)."""
        mode = ExternalParamMode(self) if self.enabled and self.modes_active == 0 else None
        if mode is not None:
            mode.__enter__()
        self._outside.append(mode)

    def _leave_outside(self, m: nn.Module, args, out) -> None:
        mode = self._outside.pop() if self._outside else None
        if mode is not None:
            mode.__exit__(None, None, None)

    def reinstall(self) -> None:
        """Hook the model again (after ``remove``, or to pick up new external registrations), once:
        the hooks still in place are replaced, not doubled."""
        self.remove()
        self.install_forward()
        self.gather_before_gradient(self._trainable)

    def _count_forward(self, m: nn.Module, args) -> None:
        self.forwards[0 if torch.is_grad_enabled() else 1] += 1

    def _pre_forward(self, m: nn.Module, args) -> None:
        if not self.enabled:
            return
        with self.own_work():
            self.fetcher.fetch(self.units[m], self.names[m])
        self.frames.append([])
        self.running.append({id(sp) for sp in self.units[m]})

    def _post_forward(self, m: nn.Module, args, out) -> None:
        if not self.enabled:
            return
        externals = self.frames.pop() if self.frames else []
        if self.running:
            self.running.pop()
        unit = self.units[m]
        with self.own_work():
            self.fetcher.release(unit + externals)
        if torch.is_grad_enabled():
            self._fetch_before_backward(out, unit, self.names[m] + " (backward)")

    def _fetch_before_backward(self, out: Any, unit: list[ShardedParam], tag: str) -> None:
        fetched_in = [
            -1
        ]  # the backward that fetched for this output: once per backward, however many outputs

        def fetch(grad):
            if fetched_in[0] != self.backward_count:
                fetched_in[0] = self.backward_count
                self.fetcher.fetch(unit, tag)
            return None

        hook = self.wrap(fetch)
        for t in _tensors(out):
            t.register_hook(hook)

    @contextlib.contextmanager
    def own_work(self):
        previous, self.internal = self.internal, True
        try:
            yield
        finally:
            self.internal = previous

    def is_external(self, sp: ShardedParam) -> bool:
        """True when no running module owns ``sp`` (so no module hook covers its backward)."""
        return not any(id(sp) in ids for ids in self.running)

    def external_use(self, params: list[ShardedParam], func, args, kwargs):
        """Run ``func`` that reads sharded parameters outside their module's forward."""
        tag = "external " + ",".join(sp.name for sp in params)
        with self.own_work():
            self.fetcher.fetch(params, tag)
        out = func(*args, **kwargs)
        with self.own_work():
            out = _not_a_view(out, params)
        if self.frames:
            self.frames[-1].extend(params)
        else:
            with self.own_work():
                self.fetcher.release(params)
        if torch.is_grad_enabled():
            self._fetch_before_backward(out, params, tag + " (backward)")
        return out

    def mode(self) -> "ExternalParamMode":
        return ExternalParamMode(self)

    def gather_before_gradient(self, params: list[ShardedParam]) -> None:
        """Hook each of ``params`` (the trainable ones) so that its gradient finds it whole (see the
        module's docstring); a no-op check when the module hooks gathered it, as they usually do."""
        self._trainable = list(params)
        for sp in params:
            if sp.param.requires_grad:
                hook = sp.param.register_hook(self._whole_before_gradient(sp))
                self.backward_handles.append(hook)

    def _whole_before_gradient(self, sp: ShardedParam) -> Callable:
        def gather(sp: ShardedParam) -> None:
            with self.own_work():
                self.fetcher.fetch([sp], sp.name + " (gradient)")

        def hook(grad: torch.Tensor) -> None:
            if sp.state is ParamState.SHARDED:
                self.wrap(gather)(sp)  # (compiled autograd: eager, as the other backward gathers)

        return hook

    def backward_done(self) -> None:
        """A backward ended: a later backward through a retained graph fetches again."""
        self.backward_count += 1

    def remove(self) -> None:
        """Take every hook off (the model then runs as plain torch: on whole parameters only)."""
        for h in self.forward_handles + self.backward_handles:
            h.remove()
        self.forward_handles, self.backward_handles = [], []

    def close(self) -> None:
        """The engine is done with the model: every hook off, the forward count's too."""
        self.remove()
        self._count_handle.remove()


def _param_args(args, kwargs):
    """The parameters an op receives, also inside a list or tuple argument (``torch.cat([q.weight, k.weight])``,
    ``torch.stack(list(param_list))``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, nn.Parameter):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, nn.Parameter):
                    yield b


class ExternalParamMode(TorchFunctionMode):
    """Gathers sharded parameters that an op receives while they are not gathered."""

    def __init__(self, hooks: ModuleHooks):
        super().__init__()
        self.hooks = hooks

    def __enter__(self):
        self.hooks.modes_active += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.hooks.modes_active -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.hooks.enabled and not self.hooks.internal:
            # Every external use is fetched (a no-op when gathered) and hooked for backward, gathered or
            # not: backward may reach this op after the parameter was released again.
            found = []
            for a in _param_args(args, kwargs):
                sp = lookup(a)
                if sp is not None and sp not in found and self.hooks.is_external(sp):
                    found.append(sp)
            if found:
                return self.hooks.external_use(found, func, args, kwargs)
        return func(*args, **kwargs)
