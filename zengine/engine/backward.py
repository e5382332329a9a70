"""Bracketing each backward pass, whoever starts it: ``engine.backward(loss)`` or a plain ``loss.backward()``.

The stage's gradient store must know when a backward begins (is it a
boundary? under ``no_sync``?) and when it ends (launch the buckets still
waiting, wait for every reduction). ``engine.backward`` says so itself.
Real DeepSpeed scripts often call ``loss.backward()`` and then
``engine.step()``; that backward is caught here:

- the engine's forward outputs carry a gradient hook. When a backward
  reaches them that ``engine.backward`` did not start, the hook opens the
  bracket and, with fp16, multiplies the incoming gradient by the loss
  scale over the accumulation steps: the factor ``engine.backward``
  applies to the loss, applied one step later in the chain rule (the loss
  function's own backward then runs unscaled). The bracket closes in a callback autograd runs when the pass
  is over.
- when no output carried the hook (the model returned a type the engine
  cannot look into) the first parameter gradient opens the bracket. That
  backward is unscaled: fine when the factor is 1 (fp32, bf16), refused by
  name at ``step()`` when it is not.

In fp32 and bf16 the division by ``gradient_accumulation_steps`` is not a
factor here: the step applies it once to the summed gradients
(``ZeroOptimizer.grad_unscale``).
A factor applied at the outputs would count again for a gradient that passes
through two outputs (a model returning ``(loss, logits)``), through another
engine's outputs (chained engines), or none (a term computed outside the
forward). With fp16 the factor still rides on the outputs (to keep fp16's range), so a plain
``loss.backward()`` of a loss that reaches the parameters through several
outputs is scaled more than once: use ``engine.backward(loss)`` there.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten


class BackwardMode(enum.Enum):
    IDLE = "idle"            # no backward pass in progress
    EXPLICIT = "explicit"    # inside engine.backward(loss): the loss was scaled there
    IMPLICIT = "implicit"    # a plain loss.backward() that reached a hooked output: scaled at the outputs
    UNSCALED = "unscaled"    # a plain loss.backward() seen first at a parameter: nothing was scaled


class BackwardTracker:
    """Opens and closes the gradient store's bracket around every backward pass through the model."""

    def __init__(self, begin: Callable[[], None], end: Callable[[], None], factor: Callable[[], float]):
        self._begin = begin    # optimizer.begin_backward with the engine's boundary / no_sync state
        self._end = end        # optimizer.end_backward
        self._factor = factor  # 1 in fp32/bf16; the fp16 loss scale / gradient_accumulation_steps
        self.mode = BackwardMode.IDLE
        self.unscaled_since_step = False  # an UNSCALED backward ran since the last step

    @contextlib.contextmanager
    def explicit(self):
        """``engine.backward``: the loss is already scaled; bracket the pass."""
        if self.mode is not BackwardMode.IDLE:
            raise RuntimeError("engine.backward() was called inside another backward pass (from a gradient hook?)")
        self._begin()
        self.mode = BackwardMode.EXPLICIT
        try:
            yield
        finally:
            self.mode = BackwardMode.IDLE
        self._end()

    def hook_outputs(self, out: Any) -> None:
        """Give the forward's differentiable outputs the gradient hook that catches a plain backward."""
        leaves, _ = tree_flatten(out)
        for t in leaves:
            if torch.is_tensor(t) and t.requires_grad and t.is_floating_point():
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor):
        if self.mode is BackwardMode.EXPLICIT:
            return None
        if self.mode is BackwardMode.IDLE:
            self._open(BackwardMode.IMPLICIT)
        if self.mode is BackwardMode.IMPLICIT:
            factor = self._factor()
            return grad * factor if factor != 1.0 else None
        return None

    def on_param_grad(self) -> None:
        """Called before the store handles a parameter's gradient: opens the bracket if nobody did."""
        if self.mode is BackwardMode.IDLE:
            self.unscaled_since_step = True
            self._open(BackwardMode.UNSCALED)

    def _open(self, mode: BackwardMode) -> None:
        self._begin()
        self.mode = mode
        torch.autograd.Variable._execution_engine.queue_callback(self._close)

    def _close(self) -> None:
        self.mode = BackwardMode.IDLE
        self._end()

    def check_step(self) -> None:
        """At ``step()``: refuse gradients from a backward that could not be scaled when scaling matters."""
        unscaled, self.unscaled_since_step = self.unscaled_since_step, False
        factor = self._factor()
        if unscaled and factor != 1.0:
            raise RuntimeError(
                f"engine.step(): gradients came from a loss.backward() that did not pass through the engine's "
                f"outputs, so the engine could not apply its fp16 factor {factor:g} (loss scale / "
                f"gradient_accumulation_steps). Call engine.backward(loss), or return the loss (or tensors) "
                f"from the model's forward so that the engine can scale a plain loss.backward().")
