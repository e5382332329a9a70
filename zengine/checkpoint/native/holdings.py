"""Where an engine keeps what a checkpoint holds: the tensors saving reads from and loading writes into.

Every kind of value is a ``Holding``: a 1-D tensor and the pieces of
parameters it holds (see ``pieces.py``). Trained parameters: each group's
fp32 master, and each per-element optimizer state tensor with the same
pieces. Parameters the optimizer does not train: the module's own tensors at
stages 0-2 (replicated, so saving splits them evenly over the ranks), the
frozen group's shard at stage 3. Buffers are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .pieces import Piece, group_pieces, saved_pieces, split_pieces


@dataclass
class Holding:
    """``buffer[p.offset : p.offset + p.numel]`` holds elements ``[p.start, p.end)`` of parameter ``p.name``."""

    buffer: torch.Tensor  # 1-D, any dtype and device
    pieces: list[Piece]

    def view(self, piece: Piece) -> torch.Tensor:
        return self.buffer.narrow(0, piece.offset, piece.numel)


def zero_gaps(buffer: torch.Tensor, pieces: list[Piece]) -> None:
    """Zero the elements of ``buffer`` that no piece covers (shard padding)."""
    pos = 0
    for p in sorted(pieces, key=lambda p: p.offset):
        if p.offset > pos:
            buffer[pos : p.offset].zero_()
        pos = max(pos, p.offset + p.numel)
    if pos < buffer.numel():
        buffer[pos:].zero_()


def group_names(group) -> list[str]:
    """The parameter names of a stage 0-2 or stage-3 group."""
    return list(group.names) if hasattr(group, "names") else [sp.name for sp in group.sharded]


def param_group_names(optimizer) -> list[list[str]]:
    """The parameter names of each param group of the wrapped optimizer (partial offload's
    sub-groups joined: ``zero/sub_groups.py``)."""
    groups = optimizer.groups
    return [
        [n for gi in optimizer.group_map.members(pg) for n in group_names(groups[gi])]
        for pg in range(optimizer.group_map.count)
    ]


def trained_names(optimizer) -> set[str]:
    return {n for g in optimizer.groups for n in group_names(g)}


def elementwise_state(optimizer, gi: int) -> dict[str, torch.Tensor]:
    """The optimizer state tensors of group ``gi`` shaped like its master shard (exp_avg, momentum_buffer...)."""
    shard = optimizer.shard_params[gi]
    return {
        k: v
        for k, v in optimizer.optimizer.state.get(shard, {}).items()
        if torch.is_tensor(v) and v.shape == shard.shape
    }


def param_group_state(optimizer, gi: int) -> dict[str, torch.Tensor]:
    """``elementwise_state(optimizer, gi)``, with zeros for the keys other groups of its param group
    hold and it lacks: a sub-group whose parameters never stepped (no gradient yet) has no state,
    where one flat shard over the param group holds zeros for them; a reader of every parameter's
    state (DCP into FSDP2's optimizer) finds them either way."""
    own = elementwise_state(optimizer, gi)
    shard = optimizer.shard_params[gi]
    for other in optimizer.group_map.members(optimizer.group_map.owner[gi]):
        for key, value in elementwise_state(optimizer, other).items():
            if key not in own:
                own[key] = torch.zeros(shard.shape, dtype=value.dtype, device=shard.device)
    return own


def masters(optimizer, world: int, saving: bool) -> list[Holding]:
    """One Holding per group: its fp32 master, with the pieces this rank saves (or, loading, all it holds)."""
    return [
        Holding(m, saved_pieces(g, world) if saving else group_pieces(g))
        for g, m in zip(optimizer.groups, optimizer.masters)
    ]


def untrained(module: nn.Module, optimizer, rank: int, world: int, saving: bool) -> list[Holding]:
    """Parameters outside the optimizer's groups, in the compute dtype."""
    frozen = getattr(optimizer, "frozen", None)
    if frozen is not None:  # stage 3: sharded like the others, in a group of their own
        return [
            Holding(
                frozen.shard_flat, saved_pieces(frozen, world) if saving else group_pieces(frozen)
            )
        ]
    trained = trained_names(optimizer)
    params = [(n, p) for n, p in module.named_parameters() if n not in trained]
    if saving:
        share = split_pieces(
            [n for n, _ in params], [tuple(p.shape) for _, p in params], rank, world
        )
        return [Holding(p.detach().view(-1), [s for s in share if s.name == n]) for n, p in params]
    return [Holding(p.detach().view(-1), [Piece(n, 0, p.numel(), 0)]) for n, p in params]


def frozen_names(module: nn.Module) -> frozenset[str]:
    """The parameters that do not require grad (what ``exclude_frozen_parameters`` leaves out)."""
    return frozenset(n for n, p in module.named_parameters() if not p.requires_grad)


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers (those ``state_dict`` keeps), by name."""
    out = {}
    for prefix, m in module.named_modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                out.setdefault(f"{prefix}.{n}" if prefix else n, b)
    return out
