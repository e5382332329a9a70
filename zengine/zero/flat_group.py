"""One optimizer parameter group's trainable parameters, flattened.

The module's parameters become views into one padded buffer in the compute
dtype, so that a single collective moves a whole bucket and a checkpoint can
address every element by (name, offset). The optimizer never sees these
parameters: it steps a flat fp32 master (whole at stage 0, one shard at
stages 1-2), see ``optimizer.py``.

``ParamGroup`` is the role the step, the master stores and the checkpoints
see; stage 3's ``stage3/group.ShardedParamGroup`` plays it too.
"""

from __future__ import annotations

import contextlib

from typing import Any, Protocol, Sequence

import torch
from torch import nn

from ..distributed import collectives
from .layout import FlatLayout, chunk_ranges, intersect


class ParamGroup(Protocol):
    """One optimizer param group's trainable parameters as the ZeRO step sees them: this rank's
    shard in the compute dtype, where each parameter's elements sit in it, the part it counts in
    the norm, and how the other ranks get the updated parameters."""

    params: list[nn.Parameter]
    hyper: dict[str, Any]  # the group's own hyper-parameters (lr, weight_decay, ...)
    used: list[bool]  # per parameter: got a gradient since the last boundary
    in_memory: bool  # the parameters are tensors here (stage 3's may live in a swap file)
    replicated: bool  # every rank's master covers the whole group (stage 0)

    def lost_writes(self) -> list[tuple[str, str]]:
        """(name, why) of each parameter a script wrote in a way the step would lose."""
        ...

    @property
    def owned(self) -> tuple[int, int]:
        """The flat range this rank's master covers."""

    def params_version(self) -> int:
        """Changes whenever a parameter is written in place."""

    def owned_params(self) -> torch.Tensor:
        """This rank's shard of the compute-dtype parameters ([owned numel])."""

    def master_pieces(self) -> list[tuple[int, int, int]]:
        """(param index, lo, hi): where each parameter's owned elements sit in the master shard."""

    def param_pieces(self, pi: int) -> list[tuple[int, int, int]]:
        """(lo, hi, start): master[lo:hi] holds parameter pi's flat elements from ``start`` on."""

    def param_shape(self, pi: int) -> tuple:
        """Parameter pi's full shape."""

    def norm_range(self, world: int) -> tuple[int, int]:
        """The part of the master (gradient) whose squares this rank adds to the global norm."""

    def publish(self, bucket_numel: int, comm_group=None) -> None:
        """After the step: the ranks that need the updated parameters get them."""

    def param_names(self) -> list[str]:
        """The parameters' names, in ``params`` order."""

    def tensors(self) -> list[torch.Tensor]:
        """The parameter storage this group holds (for memory accounting)."""


class FlatParamGroup:
    """Trainable parameters of one param group, end to end in ``self.flat`` (a ``ParamGroup``)."""

    in_memory = True  # the parameters are tensors here (a stage-3 group's may live in a swap file)

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        hyper: dict[str, Any],
        num_shards: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.hyper = hyper  # the group's own hyper-parameters (lr, weight_decay, ...)
        self.layout = FlatLayout(self.names, [tuple(p.shape) for p in self.params], num_shards)
        self.rank = rank
        # [padded] compute dtype. Made empty and filled parameter by parameter, each parameter's old storage
        # freed as soon as it is copied: the pages of the buffer are touched one parameter at a time, so the
        # rank never holds the model twice (a zeroed buffer would be touched whole at once).
        self.flat = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            self.flat[self.layout.numel :].zero_()  # the padding
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

    def lost_writes(self) -> list[tuple[str, str]]:
        """(name, why) of each parameter whose ``.data`` is no longer its view of ``flat`` (a script's
        ``p.data = tensor``: the step would not reach it; param_writes.py)."""
        base, size = self.flat.data_ptr(), self.flat.element_size()
        return [
            (name, ".data was replaced by another tensor")
            for name, p, span in zip(self.names, self.params, self.layout.spans)
            if p.data_ptr() != base + span.offset * size or p.dtype != self.flat.dtype
        ]

    def params_version(self) -> int:
        """The sum of the parameters' version counters: every in-place write through a parameter bumps its own
        (a parameter keeps its counter when its ``.data`` became a view of ``flat``, so ``flat``'s does not move)."""
        return sum(p._version for p in self.params)

    def owned_params(self) -> torch.Tensor:
        """This rank's slice of the flat parameters (a view)."""
        lo, hi = self.owned
        return self.flat[lo:hi]

    def master_pieces(self) -> list[tuple[int, int, int]]:
        """(param index, lo, hi): where each parameter's owned elements sit in the master shard."""
        o0, o1 = self.owned
        out = []
        for i, span in enumerate(self.layout.spans):
            piece = intersect((span.offset, span.end), (o0, o1))
            if piece:
                out.append((i, piece[0] - o0, piece[1] - o0))
        return out

    @property
    def replicated(self) -> bool:
        """True when every rank's master covers the whole group (stage 0)."""
        return self.layout.num_shards == 1

    def param_pieces(self, pi: int) -> list[tuple[int, int, int]]:
        """(lo, hi, start): master[lo:hi] holds parameter pi's flat elements from ``start`` on."""
        o0 = self.owned[0]
        span = self.layout.spans[pi]
        piece = intersect((span.offset, span.end), self.owned)
        return [(piece[0] - o0, piece[1] - o0, piece[0] - span.offset)] if piece else []

    def param_shape(self, pi: int) -> tuple:
        return tuple(self.layout.spans[pi].shape)

    def norm_range(self, world: int) -> tuple[int, int]:
        """The part of the master (gradient) whose squares this rank adds to the global norm.

        Sharded: all of it. Replicated (stage 0): an even split, so that each
        rank does 1/world of the work and the all-reduce adds up the whole.
        """
        if self.layout.num_shards > 1:
            return 0, self.layout.shard_numel
        n = self.layout.padded_numel
        per = -(-n // world)
        return min(self.rank * per, n), min((self.rank + 1) * per, n)

    def publish(self, bucket_numel: int, comm_group=None) -> None:
        """After the step: fill the other ranks' slices of ``flat`` from their owners, bucket by bucket."""
        if self.layout.num_shards == 1:
            return
        world = self.layout.num_shards
        shard = self.layout.shard_numel
        for lo, hi in chunk_ranges(shard, max(1, bucket_numel // world)):
            collectives.gather_strided(self.flat, shard, lo, hi, self.rank, world, comm_group)

    def param_names(self) -> list[str]:
        """The parameters' names, in ``params`` order."""
        return list(self.names)

    def tensors(self) -> list[torch.Tensor]:
        """The parameter storage this group holds (for memory accounting)."""
        return [self.flat]


@contextlib.contextmanager
def whole_params(groups: list, masters: list[torch.Tensor], writeback: bool):
    """A context over parameters that are whole already (stages 0-2): with ``writeback`` what the
    body wrote into them goes into the fp32 ``masters`` on exit (where a master is not the
    parameters' own storage); without, the body's writes are undone on exit."""
    snapshot = None if writeback else [[t.clone() for t in g.tensors()] for g in groups]
    try:
        yield
    finally:
        with torch.no_grad():
            for g, master in zip(groups, masters):
                if snapshot is not None:
                    for t, saved in zip(g.tensors(), snapshot.pop(0)):
                        t.copy_(saved)
                elif master.data_ptr() != g.owned_params().data_ptr():
                    master.copy_(g.owned_params())
