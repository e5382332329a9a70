"""One optimizer parameter group's trainable parameters, flattened.

The module's parameters become views into one padded buffer in the compute
dtype, so that a single collective moves a whole bucket and a checkpoint can
address every element by (name, offset). The optimizer never sees these
parameters: it steps a flat fp32 master (whole at stage 0, one shard at
stages 1-2), see ``optimizer.py``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .layout import FlatLayout


class FlatParamGroup:
    """Trainable parameters of one param group, laid end to end in ``self.flat``."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], hyper: dict[str, Any],
                 num_shards: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.hyper = hyper  # the group's own hyper-parameters (lr, weight_decay, ...)
        self.layout = FlatLayout(self.names, [tuple(p.shape) for p in self.params], num_shards)
        self.rank = rank
        self.flat = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)  # [padded] compute dtype
        with torch.no_grad():
            for p, span in zip(self.params, self.layout.spans):
                view = self.flat.narrow(0, span.offset, span.numel)
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(span.shape)
        # Which parameters got a gradient since the last boundary (unused ones are left untouched).
        self.used = [False] * len(self.params)

    @property
    def owned(self) -> tuple[int, int]:
        """The flat range this rank's master covers."""
        return self.layout.shard_range(self.rank if self.layout.num_shards > 1 else 0)

    def owned_params(self) -> torch.Tensor:
        """This rank's slice of the flat parameters (a view)."""
        lo, hi = self.owned
        return self.flat[lo:hi]

    def param_ranges(self, indices: Sequence[int]) -> list[tuple[int, int]]:
        """Flat ranges of the given parameters."""
        return [(self.layout.spans[i].offset, self.layout.spans[i].end) for i in indices]
