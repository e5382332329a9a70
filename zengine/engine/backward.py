"""Bracketing each backward pass, whoever starts it: ``engine.backward(loss)`` or a plain ``loss.backward()``.

The stage's gradient store must know when a backward begins (is it a
boundary? under ``no_sync``?) and when it ends (launch the buckets still
waiting, wait for every reduction). ``engine.backward`` says so itself.
Real DeepSpeed scripts often call ``loss.backward()`` and then
``engine.step()``; that backward is caught here:

- the engine's forward outputs carry a gradient hook. When a backward
  reaches them that ``engine.backward`` did not start, the hook opens the
  bracket; the bracket closes in a callback autograd runs when the pass is over.
- when no output carried the hook (the model returned a type the engine
  cannot look into) the first parameter gradient opens the bracket.

Nothing is multiplied on the way: a gradient is scaled exactly once, by
whatever the pass's loss was multiplied by, whatever path it took to its
parameter (a model returning ``(loss, logits)`` with the loss built from the
logits, another engine's outputs, a term computed outside the forward, an
engine called twice). That factor is 1 in fp32 and bf16 (the step divides by
``gradient_accumulation_steps``), and with fp16 the loss scale over the
accumulation steps for a pass that ``engine.backward`` started (DeepSpeed's
way, to keep fp16's range). Every engine the pass reaches (chained engines)
records the factor of the pass, not its own: it is the root's loss that was
scaled. A plain ``loss.backward()`` in fp16 has nothing to scale (the engine
never sees the loss): it runs with factor 1, correct but without the loss
scale's protection against underflow, and the engine says so once.
The step divides the summed gradients by the factor its accumulation window
carried (``precision/grad_factor.GradFactor``, which owns every part of that
factor); a window whose passes carried different factors (``engine.backward``
and a plain fp16 ``loss.backward()`` mixed before one step) is refused by
name at ``step()``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten

from ..precision.grad_factor import GradFactor

logger = logging.getLogger("zengine")


class BackwardMode(enum.Enum):
    IDLE = "idle"  # no backward pass in progress
    EXPLICIT = "explicit"  # inside engine.backward(loss): the loss was scaled there
    IMPLICIT = (
        "implicit"  # a pass this engine did not start: a plain loss.backward(), or another engine's
    )


class BackwardTracker:
    """Opens and closes the gradient store's bracket around every backward pass through the model, and
    records the factor the gradients of the current accumulation window carry."""

    def __init__(self, begin: Callable[[], None], end: Callable[[], None], factor: GradFactor):
        self._begin = begin  # optimizer.begin_backward with the engine's boundary / no_sync state
        self._end = end  # optimizer.end_backward
        self._factor = factor  # loss_factor(); told what the window's gradients carry
        self.mode = BackwardMode.IDLE
        self._window: Optional[float] = None  # the factor of this accumulation window's first pass
        self._mixed: Optional[tuple[float, float]] = None
        self._warned_unscaled = False
        self.output_hook: Callable = (
            self._on_output_grad
        )  # compiled autograd: wrapped in torch.compiler.disable

    @contextlib.contextmanager
    def explicit(self, carried: Optional[float] = None):
        """``engine.backward``: the loss is already multiplied by ``factor()``; bracket the pass. ``carried``:
        what the pass's gradients carry when that is not ``factor()`` (a loss the caller divided by the
        accumulation steps: ``scale_wrt_gas=False``)."""
        if self.mode is not BackwardMode.IDLE:
            raise RuntimeError(
                "engine.backward() was called inside another backward pass (from a gradient hook?)"
            )
        factor = self._factor.loss_factor() if carried is None else carried
        self._note(factor)
        self._begin()
        self.mode = BackwardMode.EXPLICIT
        try:
            with GradFactor.running_pass(factor):
                yield
        finally:
            self.mode = BackwardMode.IDLE
        self._end()

    def hook_outputs(self, out: Any) -> None:
        """Give the forward's differentiable outputs the gradient hook that catches a plain backward."""
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if torch.is_tensor(t) and t.requires_grad and t.is_floating_point():
                t.register_hook(self.output_hook)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self.mode is BackwardMode.IDLE:
            self._open()
        return None  # nothing multiplied: see the module doc

    def on_param_grad(self) -> None:
        """Called before the store handles a parameter's gradient: opens the bracket if nobody did."""
        if self.mode is BackwardMode.IDLE:
            self._open()

    def _open(self) -> None:
        factor = GradFactor.of_running_pass()
        if factor is None:  # a plain loss.backward(): nobody scaled its loss
            factor = 1.0
            if self._factor.loss_factor() != 1.0 and not self._warned_unscaled:
                self._warned_unscaled = True
                logger.warning(
                    "zengine: fp16 with a plain loss.backward(): the engine cannot scale a loss it "
                    "never sees, so this backward runs without the loss scale (correct, but small "
                    "gradients may underflow in fp16); engine.backward(loss) applies it"
                )
        self._note(factor)
        self._begin()
        self.mode = BackwardMode.IMPLICIT
        torch.autograd.Variable._execution_engine.queue_callback(self._close)

    def _close(self) -> None:
        self.mode = BackwardMode.IDLE
        self._end()

    def _note(self, factor: float) -> None:
        """The window's gradients carry ``factor``; a pass with another factor in the same window is refused."""
        if self._window is None:
            self._window = factor
            self._factor.window_carries(factor)
        elif factor != self._window and self._mixed is None:
            self._mixed = (self._window, factor)

    def check_step(self) -> None:
        """At ``step()``: refuse a window whose passes carried different factors (their sum is no gradient)."""
        if self._mixed is not None:
            first, other = self._mixed
            self._mixed = None
            raise RuntimeError(
                f"engine.step(): the backward passes since the last step carried different factors ({first:g} and "
                f"{other:g}), so their gradients do not add up: with fp16, engine.backward(loss) multiplies the loss "
                f"by the loss scale over the accumulation steps and a plain loss.backward() cannot; "
                f"engine.backward(loss, scale_wrt_gas=False) takes a loss already divided by them. Use one of "
                f"them for every micro-step of an accumulation window."
            )

    def end_window(self) -> None:
        """After a boundary step: the next pass starts a new window."""
        self._window = None
        self._factor.window_carries(None)
