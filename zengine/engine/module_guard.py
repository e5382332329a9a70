"""``engine.module`` calls that change what the engine owns: followed or refused, never half-applied.

After ``initialize`` the engine owns the model's parameters: at stages 0-2 they are views into flat
buffers in the compute dtype, at stage 3 shards, and the accumulated gradients live in the stage's
gradient store, not in ``.grad``. Two ``nn.Module`` methods a script calls on ``engine.module`` would
silently miss or break that:

- ``zero_grad()`` in the middle of an accumulation window (before each micro-step): torch then keeps
  only the gradients of the backwards after it. The root module's call is followed: the engine drops
  what the window accumulated, on this rank (every rank runs the same script). A sub-module's call
  would drop only some parameters' gradients, which the gradient store cannot do: refused by name.
  Outside a window (right after a boundary step) both are what torch's are: nothing to drop.
- ``_apply``, through which ``.to()``, ``.half()``, ``.float()``, ``.double()``, ``.bfloat16()``,
  ``.cuda()``, ``.cpu()``, ``.type()`` and ``.to_empty()`` go: a call that would give a parameter a new
  tensor of another dtype (or ``to_empty``'s) would cut it from the engine's buffers: refused by name
  before any parameter changes. A move to another device is followed, as torch's (Lightning's
  teardown moves the module to the CPU at the end of a run); the engine's forward, backward and step
  then raise by name. One that changes nothing (``.to("cpu")`` on a CPU run) runs as torch's.
- at stage 3, ``apply(fn)`` and ``load_state_dict`` outside a gather (``summon_full_params``,
  ``GatheredParameters``): the shards see no write to what the module shows, an empty tensor (a
  partitioned parameter) or a whole persistent one. ``apply`` is refused by name once it returns when
  ``fn`` wrote such a parameter in place (the version counters say so; the persistent ones are put
  back), ``load_state_dict`` before anything is loaded. Both name the way out: the same call inside
  ``engine.summon_full_params()`` on every rank, which is followed.

The guard's methods are instance attributes of each module; ``copy.deepcopy`` and pickling give the
copy its class's own methods (``_GuardedCall.__reduce__``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..zero.stage3.param import ParamState, lookup


class EngineModuleError(RuntimeError):
    """A call on ``engine.module`` would change what the engine owns in a way it cannot follow (a cast
    or a move of its parameters, a sub-module's ``zero_grad`` mid-window). Raised before anything
    changed."""


class _GuardedCall:
    """``module.<name>`` replaced by ``guard(module, original, *args)``; copies and pickles as the
    class's own method of the copied module."""

    def __init__(self, module: nn.Module, name: str, guard: Callable):
        self.module, self.name, self.guard = module, name, guard
        self.original = getattr(type(module), name).__get__(module)

    def __call__(self, *args, **kwargs):
        return self.guard(self.module, self.original, *args, **kwargs)

    def __reduce__(self):
        return getattr, (self.module, self.name)


class ModuleGuard:
    """Installs the guarded ``zero_grad`` and ``_apply`` on every module of ``model``.

    ``window_open()`` says whether gradients accumulated since the last boundary step;
    ``drop_window(set_to_none)`` forgets them (the engine's optimizer)."""

    def __init__(
        self,
        model: nn.Module,
        window_open: Callable[[], bool],
        drop_window: Callable[[bool], None],
    ):
        self.root = model
        self.window_open = window_open
        self.drop_window = drop_window
        self.names = {id(m): n for n, m in model.named_modules()}
        self.modules = [m for _, m in model.named_modules()]
        self.moved: str | None = None  # which parameter moved where, once the module moved
        self._applying = 0  # nesting depth of apply calls (children's run inside their parent's)
        guards = {
            "zero_grad": self._zero_grad,
            "_apply": self._apply,
            "apply": self._apply_fn,
            "load_state_dict": self._load_state_dict,
        }
        for m in self.modules:
            for name, guard in guards.items():
                m.__dict__[name] = _GuardedCall(m, name, guard)

    def remove(self) -> None:
        """The modules get their class's methods back (``engine.destroy()``)."""
        for m in self.modules:
            for name in ("zero_grad", "_apply", "apply", "load_state_dict"):
                m.__dict__.pop(name, None)

    def _name(self, module: nn.Module) -> str:
        name = self.names.get(id(module), "")
        return "engine.module" + (f".{name}" if name else "")

    def _zero_grad(self, module: nn.Module, original: Callable, set_to_none: bool = True) -> None:
        open_window = self.window_open()
        if open_window and module is not self.root:
            raise EngineModuleError(
                f"zengine: {self._name(module)}.zero_grad() in the middle of a gradient accumulation "
                "window would drop the gradients of that sub-module's parameters only; the engine keeps "
                "the window's gradients in one store per parameter group and cannot. Call "
                "engine.module.zero_grad() (drops the window's gradients of every parameter, as torch "
                "does) or drop the call"
            )
        original(set_to_none)
        if open_window:
            self.drop_window(set_to_none)

    def _apply(self, module: nn.Module, original: Callable, fn: Callable, recurse: bool = True):
        moved = None
        with torch.no_grad():  # (as torch's _apply runs fn)
            for name, p in module.named_parameters(recurse=recurse):
                changed = fn(p)
                if changed is p:
                    continue
                where = f"{self._name(module)}.{name}".replace("engine.module.", "", 1)
                if changed.dtype == p.dtype and changed.device != p.device:
                    moved = moved or f"{where} from {p.device} to {changed.device}"
                    continue
                raise EngineModuleError(
                    f"zengine: this call on {self._name(module)} (.to(), .half(), .float(), "
                    ".double(), .bfloat16(), .type() or .to_empty()) would give parameter "
                    f"{where} a new tensor ({p.dtype} on {p.device} -> {changed.dtype} on "
                    f"{changed.device}) after zengine.initialize; the engine keeps its parameters, "
                    "gradients and optimizer state in its own buffers in the configured dtype, and "
                    "would train on without the cast. Nothing was changed. Choose the precision in "
                    "the config (bf16 / fp16 enabled) or cast the model before zengine.initialize; "
                    "for a copy in another dtype, build a separate model from the weights "
                    "(engine.module.state_dict() inside engine.summon_full_params() at stage 3)"
                )
        if moved is not None:  # followed, as at the end of a run (Lightning's teardown: .cpu())
            self.moved = moved
        return original(fn, recurse)

    def check(self, what: str) -> None:
        """Raise ``EngineModuleError`` for ``engine.<what>()`` once the module was moved to another
        device: its parameters left the engine's buffers, training on would not reach them."""
        if self.moved is not None:
            raise EngineModuleError(
                f"zengine: engine.{what}() after engine.module was moved to another device "
                f"({self.moved}): its parameters are no longer the engine's buffers, so the engine "
                "cannot train or run it. Move the model before zengine.initialize (the engine places "
                "it on its device), or build a new engine over the moved model"
            )

    def _apply_fn(self, module: nn.Module, original: Callable, fn: Callable):
        if self._applying:  # a child's, inside its parent's: the outermost call checks
            return original(fn)
        # stage 3, outside a gather: persistent parameters stay whole, and a write to them would not
        # reach their shards; kept to be put back (they are small: the persistence threshold)
        whole = [
            (sp, sp.param._version, sp.param.detach().clone())
            for sp in _sharded(module)
            if sp.state is ParamState.GATHERED and not sp.pinned
        ]
        self._applying += 1
        try:
            original(fn)
        finally:
            self._applying -= 1
        lost = [sp for sp in _sharded(module) if sp.written_while_released]
        for sp in lost:  # (said once)
            sp.freed_version = sp.param._version
        for sp, version, value in whole:
            if sp.param._version != version:
                lost.append(sp)
                with torch.no_grad():
                    sp.param.copy_(value)
        if lost:
            names = ", ".join(sp.name for sp in lost[:8]) + (" ..." if len(lost) > 8 else "")
            raise EngineModuleError(
                f"zengine: {self._name(module)}.apply(fn) wrote {len(lost)} stage-3 parameter(s) "
                f"in place outside a gather ({names}): their shards do not see such writes, so "
                "nothing was written (the partitioned ones show empty tensors; the whole ones were "
                "put back) and training would go on with the old values. Run it gathered, on every "
                f"rank: with engine.summon_full_params(): {self._name(module)}.apply(fn)"
            )
        return module

    def _load_state_dict(self, module: nn.Module, original: Callable, *args, **kwargs):
        outside = [sp for sp in _sharded(module) if not sp.pinned]
        if outside:
            raise EngineModuleError(
                f"zengine: {self._name(module)}.load_state_dict() at stage 3 outside a gather: "
                f"{len(outside)} parameter(s) are partitioned (e.g. {outside[0].name}; they show "
                "empty tensors, or whole ones whose shards would not see the load); nothing was "
                "loaded. Load gathered, on every rank: with engine.summon_full_params(): "
                f"{self._name(module)}.load_state_dict(sd) (the values reach the shards and the "
                "optimizer's masters), or use engine.load_checkpoint"
            )
        return original(*args, **kwargs)


def _sharded(module: nn.Module) -> list:
    """The stage-3 sharded parameters of ``module`` (none at stages 0-2)."""
    return [sp for sp in map(lookup, module.parameters()) if sp is not None]


def optimizer_window_drop(optimizer) -> Callable[[bool], None]:
    """``drop_window`` for a ZeRO optimizer: forget the window's gradients. With ``set_to_none=False``
    torch keeps a zero ``.grad`` on the parameters that had one, which its optimizer still steps: the
    parameters used so far stay marked used."""

    def drop(set_to_none: bool) -> None:
        used = [list(g.used) for g in optimizer.groups]
        optimizer.zero_grad()
        if not set_to_none:
            for g, flags in zip(optimizer.groups, used):
                g.used = flags

    return drop
