"""A stage-3 optimizer param group: the concatenated chunks of its trainable parameters.

It offers ``ZeroOptimizer`` the same interface as ``FlatParamGroup`` (see
``zero/optimizer.py``): this rank's shard in the compute dtype, where each
parameter's elements sit in it, the part for the global norm, and what to do
after the step (here: refresh the persistent parameters, which stay whole).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .param import ParamState, ShardedParam


class ShardedParamGroup:
    """This rank's chunks of one param group's trainable parameters, end to end in ``shard_flat``."""

    def __init__(self, sharded: Sequence[ShardedParam], hyper: dict[str, Any], dtype: torch.dtype,
                 device: torch.device, refresh: Callable[[list[ShardedParam]], None], pin: bool = False):
        self.sharded = list(sharded)
        self.params = [sp.param for sp in self.sharded]
        self.hyper = hyper
        self.offsets = []
        offset = 0
        for sp in self.sharded:
            self.offsets.append(offset)
            offset += sp.chunk
        self.shard_numel = offset
        # [sum of chunks] compute dtype; on the host with offload_param (pinned on a GPU machine)
        self.shard_flat = torch.zeros(self.shard_numel, dtype=dtype, device=device, pin_memory=pin)
        for sp, off in zip(self.sharded, self.offsets):
            sp.attach_shard(self.shard_flat.narrow(0, off, sp.chunk))
        self.used = [False] * len(self.params)
        self._refresh = refresh

    @property
    def owned(self) -> tuple[int, int]:
        return 0, self.shard_numel

    def owned_params(self) -> torch.Tensor:
        return self.shard_flat

    def master_pieces(self) -> list[tuple[int, int, int]]:
        return [(i, off, off + sp.valid) for i, (sp, off) in enumerate(zip(self.sharded, self.offsets)) if sp.valid]

    replicated = False  # each rank holds its own chunk of every parameter

    def param_pieces(self, pi: int) -> list[tuple[int, int, int]]:
        """(lo, hi, start): shard[lo:hi] holds parameter pi's flat elements from ``start`` on."""
        sp, off = self.sharded[pi], self.offsets[pi]
        return [(off, off + sp.valid, sp.rank * sp.chunk)] if sp.valid else []

    def param_shape(self, pi: int) -> tuple:
        return tuple(self.sharded[pi].shape)

    def norm_range(self, world: int) -> tuple[int, int]:
        return 0, self.shard_numel

    def publish(self, bucket_numel: int, comm_group=None) -> None:
        """Parameters that stay gathered (persistent ones) are re-gathered from the updated shards."""
        live = [sp for sp in self.sharded if sp.state is ParamState.GATHERED]
        if live:
            self._refresh(live)

    def param_names(self) -> list[str]:
        """The parameters' names, in ``params`` order."""
        return [sp.name for sp in self.sharded]

    def tensors(self) -> list[torch.Tensor]:
        return [self.shard_flat] + [sp.full for sp in self.sharded if sp.state is ParamState.GATHERED]
