"""Stage 3 under torch.compile: each gather unit's forward compiled, the fetch/release hooks left outside.

The hooks (``hooks.py``) gather a unit's parameters before the module runs and free them after: work
on storage (resizing it, swapping ``.data`` between the full view and an empty tensor), collectives and
Python bookkeeping that dynamo cannot put in a graph. They run in ``nn.Module.__call__``; the module's
``forward`` is what it calls between them. So the module's ``forward`` is compiled, not its ``__call__``:
when the compiled code runs, every parameter it reads is gathered, with the same shape, dtype and
identity on every call, so dynamo's guards pass and nothing recompiles; the autograd graph AOT autograd
builds saves the parameters themselves, whose storage the backward hooks gather again before it runs,
as in eager mode. Prefetch is the fetcher's, in the hooks, so it overlaps as before.

What is compiled (``compile_targets``): the largest subtrees that hold no hooked module below their root.
A leaf module (``set_z3_leaf_modules``: its whole subtree is one gather unit) is one such subtree, so a
model whose transformer blocks are leaves compiles one graph per block. Without leaves every module that
owns parameters is its own unit, and only those small modules compile; the code between them (a block's
residual adds, attention's reshapes) stays eager.

A unit's forward that reads another unit's parameter (``F.linear(x, self.emb.weight)``) needs the
external-use mode, which gathers it mid-forward: code dynamo cannot hold. Each unit's first training step
runs eagerly and watches for such reads; a unit that makes one stays eager, named once in the log.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Optional

import torch
from torch import nn

from .hooks import ExternalParamMode, ModuleHooks

logger = logging.getLogger("zengine")

Compiler = Callable[[Callable], Callable]
"""Turns a function into its compiled form (``torch.compile`` with the engine's backend and keywords)."""


def compile_targets(
    module: nn.Module, hooked: set, prefix: str = ""
) -> list[tuple[str, nn.Module]]:
    """(name, module) of the largest subtrees of ``module`` (named ``prefix``) holding parameters and no module
    of ``hooked`` below their root (the root itself may be hooked: its hooks run outside its forward)."""
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, m: nn.Module) -> None:
        below = [c for c in m.modules() if c is not m]
        if not any(c in hooked for c in below):
            if (
                next(m.parameters(), None) is not None
            ):  # nothing to gain from compiling a parameterless module
                out.append((name or "<root>", m))
            return
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit(prefix, module)
    return out


@contextlib.contextmanager
def _external_mode_paused():
    """Take the external-use mode off torch's mode stack while compiled code runs (the unit's own parameters
    are gathered by its hooks; dynamo would otherwise trace the mode's Python around every op)."""
    if torch._C._len_torch_function_stack() and isinstance(
        torch.overrides._get_current_function_mode(), ExternalParamMode
    ):
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield


class CompiledForward:
    """Installed as ``module.forward``: calls the compiled forward, or the eager one where it must.

    ``hooks`` (stage 3): the unit runs eagerly through its first training step (its forward, and any
    recomputation of it by activation checkpointing in that step's backward, which must save what the forward
    saved) and watches whether the forward read a parameter of another unit (the external-use mode fetched one
    into this unit's frame); such a unit stays eager. A first call without grad is the only one watched.
    """

    def __init__(
        self, module: nn.Module, name: str, compiler: Compiler, hooks: Optional[ModuleHooks] = None
    ):
        self.name = name
        self.eager = module.forward  # the bound method (or a forward the user set on the instance)
        functools.update_wrapper(
            self, self.eager
        )  # inspect.signature(module.forward) still shows the model's
        self.compiled = compiler(self.eager)
        self.hooks = hooks
        self.watching = (
            hooks is not None
        )  # until the first step has shown whether it reads other units' parameters
        self.watched_in: Optional[int] = None  # hooks.backward_count at the first watched call
        self.stays_eager = False
        self.eager_calls = (
            0  # calls that ran eagerly (the watched ones; all of them for a unit that stays eager)
        )

    def __call__(self, *args, **kwargs):
        if self.watching and self.hooks.enabled:
            if self.watched_in is None:
                self.watched_in = self.hooks.backward_count if torch.is_grad_enabled() else -1
                return self._watched(args, kwargs)
            if (
                self.watched_in == self.hooks.backward_count
            ):  # still the first step (or its recomputation)
                return self._watched(args, kwargs)
            self.watching = False
        if self.stays_eager:
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        with _external_mode_paused():
            return self.compiled(*args, **kwargs)

    def _watched(self, args, kwargs):
        frame = (
            self.hooks.frames[-1] if self.hooks.frames else []
        )  # this unit's frame: its pre-hook pushed it
        before = len(frame)
        self.eager_calls += 1
        out = self.eager(*args, **kwargs)
        if len(frame) > before and not self.stays_eager:
            self.stays_eager = True
            names = sorted({sp.name for sp in frame[before:]})
            logger.info(
                "zengine: compile: %s stays eager: its forward reads parameters of other gather units (%s), "
                "which stage 3 gathers mid-forward; make them one unit (set_z3_leaf_modules on a common "
                "parent) to compile it",
                self.name,
                ", ".join(names),
            )
        return out


def install(
    module: nn.Module, name: str, compiler: Compiler, hooks: Optional[ModuleHooks] = None
) -> CompiledForward:
    """Compile ``module``'s forward in place (its ``__call__`` and hooks stay eager); returns the wrapper."""
    wrapper = CompiledForward(module, name, compiler, hooks)
    module.forward = wrapper
    return wrapper


def compile_units(
    module: nn.Module, hooks: ModuleHooks, compiler: Compiler, prefix: str = ""
) -> list[CompiledForward]:
    """Stage 3: compile the forward of every subtree of ``module`` (named ``prefix``) that ``compile_targets``
    picks, with the hooks outside."""
    return [
        install(m, name, compiler, hooks)
        for name, m in compile_targets(module, set(hooks.units), prefix)
    ]
