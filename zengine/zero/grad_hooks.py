"""The per-parameter gradient hooks through which a ZeRO optimizer takes each gradient.

One ``register_post_accumulate_grad_hook`` per trainable parameter: autograd calls it once the
parameter's ``.grad`` holds this backward's contribution, and the stage's gradient store takes it from
there (copies it into a bucket, reduces, frees it). ``rewrap`` registers them again through a wrapper:
under compiled autograd (``engine.compile(compiled_autograd_enabled=True)``) the hooks are wrapped in
``torch.compiler.disable`` so that the backward graph calls them rather than tracing their collectives.

A sparse gradient (``nn.Embedding(sparse=True)``) is made dense before the store takes it: every store
keeps dense flat sums, and the dense sum is the same gradient (torch's optimizers step a dense
gradient's zero rows as they skip a sparse one's missing rows: SGD, Adagrad).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

Wrap = Callable[[Callable], Callable]


def _as_is(fn: Callable) -> Callable:
    return fn


def _dense(on_grad: Callable, gi: int, pi: int, param) -> None:
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.to_dense()
    on_grad(gi, pi, param)


class GradHooks:
    """``on_grad(gi, pi, param)`` hooked on parameter ``pi`` of group ``gi``, for every group's params."""

    def __init__(self, groups: Sequence, on_grad: Callable):
        self._groups = groups
        self._on_grad = on_grad
        self._handles: list = []
        self.rewrap(_as_is)

    def rewrap(self, wrap: Wrap) -> None:
        """Register the hooks again, each through ``wrap``."""
        self.remove()
        self._handles = [
            p.register_post_accumulate_grad_hook(wrap(partial(_dense, self._on_grad, gi, pi)))
            for gi, g in enumerate(self._groups)
            for pi, p in enumerate(g.params)
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
