"""``engine.compile()``: torch.compile of the engine's model at every ZeRO stage.

What is compiled is each part's ``forward``, never the engine's own work: casting the inputs, hooking
the outputs for backward, the gradient hooks and the step stay eager, and so do stage 3's fetch/release
hooks, which run around each gather unit's compiled forward (``zero/stage3/compiled.py``). Stages 0-2
compile the model's forward whole (no zengine code runs inside it: gradients are taken by hooks on the
parameters after autograd accumulates them, which AOT autograd's compiled backward does as eager
backward does).

A model compiled before ``initialize`` is compiled the way its owner asked:

- ``torch.compile(model)`` (an ``OptimizedModule``): the engine takes the model inside, so that parameter
  and checkpoint names are the model's own (no ``_orig_mod.`` prefix), and compiles it with the same
  backend and settings;
- ``model.compile()`` or ``block.compile()`` (compiled in place): kept as it is at stages 0-2; at stage 3
  each such module is compiled again per gather unit, with the same settings, since its compiled
  ``__call__`` would hold the hooks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..zero.stage3.compiled import CompiledForward, Compiler, compile_units, install
from ..zero.stage3.leaf import z3_leaf_module

logger = logging.getLogger("zengine")


class CompileError(RuntimeError):
    """A torch.compile request the engine cannot carry out as asked; the message names the way out."""


def make_compiler(backend: Any, compile_kwargs: Optional[dict]) -> Compiler:
    """``torch.compile`` with ``backend`` and ``compile_kwargs`` (its keywords: mode, fullgraph, dynamic,
    options), as a function from a callable to its compiled form."""
    kwargs = dict(compile_kwargs or {})
    if (
        "backend" in kwargs
    ):  # DeepSpeed warns and overrides; a silent override hides a mistake, so warn too
        logger.warning(
            "zengine: engine.compile: compile_kwargs['backend']=%r is overridden by backend=%r",
            kwargs.pop("backend"),
            backend,
        )
    return functools.partial(torch.compile, backend=backend, **kwargs)


def _context_of(compiled: Callable) -> Optional[Callable]:
    """The dynamo context that made ``compiled`` (what ``torch.compile`` returned for a function): applied
    to another function it compiles that one with the same backend and settings. None if not found."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled, "__closure__", None) or ():
        if isinstance(cell.cell_contents, _TorchDynamoContext):
            return cell.cell_contents
    return None


def take_user_compile(model: nn.Module) -> tuple[nn.Module, Optional[Compiler]]:
    """The model to train and, when the user passed ``torch.compile(model)``, the compiler it was made with
    (the engine compiles the inner model with it once built)."""
    eval_frame = sys.modules.get(
        "torch._dynamo.eval_frame"
    )  # not imported: nothing was compiled (its import is slow)
    if eval_frame is None or not isinstance(model, eval_frame.OptimizedModule):
        return model, None
    inner = model._orig_mod
    if not isinstance(inner, nn.Module):
        raise CompileError(
            f"zengine.initialize: the compiled model wraps a {type(inner).__name__}, not an "
            "nn.Module; pass the module itself and call engine.compile() after initialize"
        )
    return inner, model.dynamo_ctx


def compiled_in_place(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the modules of ``model`` compiled in place (``module.compile()``)."""
    return [
        (name or "<root>", m)
        for name, m in model.named_modules()
        if getattr(m, "_compiled_call_impl", None) is not None
    ]


def _make_room_for(units: list) -> None:
    """Raise dynamo's recompile limit to what the stage-3 units need. torch.compile of a bound method runs it
    through one wrapper function shared by every compiled method, and dynamo keeps its graphs per code
    object: each unit with its own parameter shapes, in training and under no_grad, is one more entry of the
    same code, and past ``recompile_limit`` (8) the rest run eagerly (a warning, nothing else)."""
    import torch._dynamo.config as dynamo_config

    needed = 2 * len(units) + 8  # training and no-grad graphs per unit, and room for the user's own
    if dynamo_config.recompile_limit < needed:
        logger.info(
            "zengine: compile: torch._dynamo.config.recompile_limit %d -> %d (stage 3 compiles %d gather "
            "units through one wrapper code object)",
            dynamo_config.recompile_limit,
            needed,
            len(units),
        )
        dynamo_config.recompile_limit = needed


class WholeModel:
    """Stages 0-2: the model's forward is compiled whole. No zengine code runs inside it (gradients are taken by
    hooks on the parameters after autograd accumulates them, which AOT autograd's compiled backward does as the
    eager backward does), so an in-place ``model.compile()`` can stand as the user made it."""

    keeps_in_place_compile = True

    def install(
        self, module: nn.Module, compiler: Compiler, roots: Optional[list], announce: bool
    ) -> list:
        """The compiled forwards installed (one: the model's)."""
        return [install(module, "<root>", compiler)]

    def leave_backward_hooks_eager(self, disable: Callable) -> None:
        """Nothing of the model's own runs in backward besides the gradient hooks (wrapped by the engine)."""

    def check_backward(self, no_sync: bool) -> None:
        """Compiled autograd runs every backward these stages make."""


class PerUnit:
    """Stage 3: each gather unit's forward compiled, the fetch/release hooks ``hooks`` around it
    (``zero/stage3/compiled.py``)."""

    keeps_in_place_compile = False  # a compiled __call__ would hold the hooks

    def __init__(self, hooks: Any):
        self.hooks = hooks

    def install(
        self, module: nn.Module, compiler: Compiler, roots: Optional[list], announce: bool
    ) -> list:
        """The compiled forwards installed under ``roots`` ((name, module) pairs; default the whole model), one
        per gather unit; ``announce``: log them (rank 0)."""
        units = []
        for name, m in roots or [("", module)]:
            m._compiled_call_impl = None  # a compiled __call__ would hold the hooks
            units += compile_units(m, self.hooks, compiler, "" if name == "<root>" else name)
        _make_room_for(units)
        leafless = not any(z3_leaf_module(getattr(u.eager, "__self__", None)) for u in units)
        if announce:
            logger.info(
                "zengine: compile: stage 3 compiles %d gather unit(s) (the hooks stay outside): %s%s",
                len(units),
                ", ".join(u.name for u in units),
                "; no unit is a leaf, so only modules that own parameters compile and the code between "
                "them stays eager: mark the blocks as leaves (zengine.utils.set_z3_leaf_modules(model, "
                "[Block]) before initialize) to compile each block whole"
                if leafless and len(units) > 1
                else "",
            )
        return units

    def leave_backward_hooks_eager(self, disable: Callable) -> None:
        """The gathers before each unit's backward run eagerly, called from compiled autograd's graph."""
        self.hooks.wrap = disable

    def check_backward(self, no_sync: bool) -> None:
        if no_sync:
            raise CompileError(
                "engine.backward under no_sync at stage 3 with compiled autograd: the unreduced "
                "gradients would stay whole on the released (empty) parameters until the boundary, "
                "which compiled autograd cannot capture; leave no_sync out (stage 3 reduces each "
                "micro-step's gradients into the shards anyway) or compile with "
                "compiled_autograd_enabled=False"
            )


def compile_plan(optimizer: Any) -> "WholeModel | PerUnit":
    """How the engine compiles the model for ``optimizer``'s stage: per gather unit where stage-3 hooks gather
    the parameters (its ``module_hooks``), else whole."""
    hooks = getattr(optimizer, "module_hooks", None)
    return WholeModel() if hooks is None else PerUnit(hooks)


class CompileMembers:
    """``engine.compile`` and ``engine.is_compiled`` (DeepSpeed's members); a mix-in of ``Engine``."""

    module: nn.Module
    optimizer: Any
    _backward: Any  # the engine's BackwardTracker (backward.py)
    _no_sync: bool  # inside engine.no_sync()
    config: Any
    global_rank: int
    _compiled_units: Optional[list] = None  # the CompiledForward wrappers installed, once compiled
    _autograd_compiler: Optional[Compiler] = (
        None  # compiled_autograd_enabled: what compiles engine.backward's graph
    )
    _plan: Optional["WholeModel | PerUnit"] = None

    @property
    def compile_plan(self) -> "WholeModel | PerUnit":
        """Whole model (stages 0-2) or per gather unit (stage 3); chosen once."""
        if self._plan is None:
            self._plan = compile_plan(self.optimizer)
        return self._plan

    @property
    def is_compiled(self) -> bool:
        """Whether the engine's model has been compiled (by ``compile()``, the config's ``compile`` section,
        or by the user before ``initialize``)."""
        return self._compiled_units is not None

    @property
    def compiled_units(self) -> list[CompiledForward]:
        """The compiled forwards, one per compiled module (the model at stages 0-2, the gather units at stage 3)."""
        return list(self._compiled_units or ())

    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: Optional[dict] = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the model with ``torch.compile(backend=backend, **compile_kwargs)`` (DeepSpeed's signature).

        Stages 0-2 compile the model's forward; stage 3 compiles each gather unit's forward, with the hooks
        that gather and free its parameters outside the compiled code (mark transformer blocks as leaves
        with ``set_z3_leaf_modules`` to compile a graph per block). A second call does nothing.
        ``compiled_autograd_enabled``: ``engine.backward`` also runs under compiled autograd, which captures
        the whole backward pass (the loss's and anything between the compiled parts too) and compiles it with
        the same backend; zengine's own backward hooks (gradient reduction, stage 3's gathers) stay eager, called
        from the compiled graph (a graph break at each). ``schedule`` (a DeepCompile pass schedule) must be
        None (``CompileError`` otherwise).
        """
        if schedule is not None:
            raise CompileError(
                "engine.compile(schedule=...): a schedule orders DeepCompile's passes, which "
                "zengine does not have; leave schedule=None"
            )
        compiler = make_compiler(backend, compile_kwargs)
        if compiled_autograd_enabled and self._autograd_compiler is None:
            import torch._dynamo

            self._autograd_compiler = compiler
            # compiled autograd would trace the hooks' collectives and bucket bookkeeping: they run eagerly
            if self.optimizer is not None:
                self.optimizer.grad_hooks.rewrap(torch._dynamo.disable)  # (zero/grad_hooks.py)
            self.compile_plan.leave_backward_hooks_eager(torch._dynamo.disable)
            self._backward.output_hook = torch._dynamo.disable(self._backward.output_hook)
        if self.is_compiled:
            logger.info("zengine: engine.compile(): the model is already compiled; nothing to do")
            return
        self._compile_with(compiler)

    def _autograd_context(self):
        """What ``engine.backward`` runs autograd inside: compiled autograd after
        ``compile(compiled_autograd_enabled=True)``, else nothing."""
        if self._autograd_compiler is None:
            return contextlib.nullcontext()
        self.compile_plan.check_backward(self._no_sync)
        from torch._dynamo import compiled_autograd

        enable = (
            getattr(compiled_autograd, "enable", None) or compiled_autograd._enable
        )  # (private in torch 2.13)
        return enable(self._autograd_compiler)

    def _compile_with(self, compiler: Compiler, roots: Optional[list] = None) -> None:
        """Install ``compiler``'s compiled forwards under ``roots`` ((name, module) pairs; default the whole
        model). The first call of each compiles, not this."""
        self._compiled_units = self.compile_plan.install(
            self.module, compiler, roots, self.global_rank == 0
        )

    def _compile_as_given(self, user_compiler: Optional[Compiler]) -> None:
        """At the end of ``__init__``: compile as the user asked before ``initialize`` (see the module's
        docstring) or as the config's ``compile`` section says."""
        if user_compiler is not None:
            self._compile_with(user_compiler)
            return
        in_place = compiled_in_place(self.module)
        if in_place and self.compile_plan.keeps_in_place_compile:
            self._compiled_units = []  # stages 0-2: torch's in-place compile stands as the user made it
            return
        if in_place:
            outermost = [
                (n, m)
                for n, m in in_place
                if not any(o is not m and m in set(o.modules()) for _, o in in_place)
            ]
            lost = [n for n, m in outermost if _context_of(m._compiled_call_impl) is None]
            if lost:
                raise CompileError(
                    f"zengine.initialize: stage 3 cannot keep the in-place compile of "
                    f"{', '.join(lost)} (its compiled __call__ would hold the gather hooks, and its "
                    "settings could not be taken over); build the model uncompiled and call "
                    "engine.compile(backend, compile_kwargs) after initialize"
                )
            units = []
            for (
                name,
                m,
            ) in outermost:  # each with its own settings (block.compile() per block makes one each)
                self._compile_with(_context_of(m._compiled_call_impl), [(name, m)])
                units += self._compiled_units
            self._compiled_units = units
            return
        cfg = self.config.compile
        if cfg.enabled:
            self.compile(backend=cfg.backend, compile_kwargs=cfg.kwargs)
