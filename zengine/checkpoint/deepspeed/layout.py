"""One object per DeepSpeed writer: what its ZeRO checkpoint files hold and how, chosen once.

DeepSpeed 0.19 writes a ZeRO checkpoint in one of two families. Stages 1-2 (``stage_1_and_2.py``,
and ``bf16_optimizer.py`` for bf16 stage 1) save one flat partition per rank and group and the
whole module state_dict in one ``mp_rank_00_model_states.pt``; stage 3 (``stage3.py``) saves each
rank's chunks of every parameter, and one model states file per rank with empty module tensors. The
reader (``reader.py``) and the export (``export.py``) ask a ``DeepSpeedLayout`` where the two
differ (file names, keys, partition sizes, frozen parameters) instead of testing the stage; the
element arithmetic itself is ``partition.py``'s.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ..native.pieces import Piece
from . import partition
from .files import make

# the DeepSpeed whose layout this writes (and the one zengine's surface follows)
DS_VERSION = "0.19.8"
_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
_COMMON_MODEL_FILE = "mp_rank_00_model_states.pt"


@dataclass(frozen=True)
class FlatGroup:
    """One optimizer group's trained parameters in DeepSpeed's flat order: names, element counts,
    and the alignment padding after each (``param_alignment_paddings``; None: none)."""

    names: Sequence[str]
    numels: Sequence[int]
    paddings: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class Partition:
    """What one rank saves of one group: the ``pieces`` of its flat fp32 master (``numel``
    elements), the group ``padding`` it records, and the elements of the optimizer's per-element
    states (``moments``: at stages 1-2 the ZeRO optimizer's span the trailing padding too)."""

    pieces: list[Piece]
    numel: int
    padding: int
    moments: int


@dataclass(frozen=True)
class OptimizerParts:
    """One rank's optimizer file before a layout arranges it: the wrapped torch optimizer's
    state_dict, per group the flat fp32 master, the padding recorded and the parameter count, the
    loss scaler (a DeepSpeed stand-in) and whether it is dynamic, and the clip value."""

    optimizer: dict[str, Any]
    masters: list[torch.Tensor]
    paddings: list[int]
    group_sizes: list[int]
    loss_scaler: Any
    dynamic: bool
    clip_grad: float


class DeepSpeedLayout(Protocol):
    """Where DeepSpeed's stage families differ in their checkpoint files, for ``world`` ranks."""

    stage: int  # the ZeRO stage the checkpoint stands for (1 for the bf16 optimizer)
    world: int
    masters_key: str  # the optimizer file's list of flat fp32 masters, one per group
    optimizer_key: str  # the optimizer file's wrapped torch optimizer state_dict

    def model_files(self) -> list[str]:
        """The model states files, the one at index r written by rank r."""

    def read_pieces(
        self,
        where: str,
        g: int,
        group: FlatGroup,
        rank: int,
        saved: int,
        rank_state: dict[str, Any],
    ) -> list[Piece]:
        """The pieces of rank ``rank``'s saved master of group ``g`` (``saved`` elements), given
        that rank's optimizer file ``rank_state``; CheckpointFileError when the size breaks the
        rules."""

    def frozen_values(self, models: list[dict], shapes: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The frozen parameters recorded in ``frozen_param_shapes``, whole and flat."""

    def splits_group(self, numels: Sequence[int], sub_group_size: int) -> bool:
        """Whether DeepSpeed would cut a group of these parameters into sub-groups."""

    def write_partition(self, group: FlatGroup, rank: int) -> Partition:
        """What rank ``rank`` saves of ``group`` (no alignment padding: the export refuses it)."""

    def optimizer_state(self, parts: OptimizerParts) -> dict[str, Any]:
        """The ``optimizer_state_dict`` entry of one rank's optimizer file."""

    def module_entry(self, whole: Callable[[], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A parameter's tensor in the module state_dict (``whole``: the parameter in ``dtype``)."""

    def frozen_records(
        self, shapes: OrderedDict, whole: Callable[[str], torch.Tensor], rank: int
    ) -> tuple[Optional[OrderedDict], Optional[OrderedDict]]:
        """(``frozen_param_shapes``, ``frozen_param_fragments``) of rank ``rank``'s model file,
        from the frozen parameters' shapes and ``whole(name)`` (in the module dtype)."""


class Stage1Layout:
    """Stage 1, DeepSpeed's ZeRO optimizer: flat partitions, each saved without the group padding
    at its end (recorded per rank in ``group_paddings``); frozen parameters only in the module
    state_dict."""

    stage = 1
    masters_key = "single_partition_of_fp32_groups"
    optimizer_key = "base_optimizer_state"

    def __init__(self, world: int):
        self.world = world

    def model_files(self) -> list[str]:
        return [_COMMON_MODEL_FILE]

    def read_pieces(
        self,
        where: str,
        g: int,
        group: FlatGroup,
        rank: int,
        saved: int,
        rank_state: dict[str, Any],
    ) -> list[Piece]:
        size = self._partition_size(saved, g, rank_state)
        # parameter_alignment may make DeepSpeed's partitions larger than this rule, never smaller
        paddings = group.paddings or [0] * len(group.numels)
        expected = partition.partition_numel(group.numels, paddings, self.world)
        if size < expected:
            partition.check_saved_numel(where, g, rank, expected, size)
        return partition.flat_group_pieces(
            group.names, group.numels, group.paddings, rank, size, saved
        )

    def _partition_size(self, saved: int, g: int, rank_state: dict[str, Any]) -> int:
        return saved + int(rank_state["group_paddings"][g])

    def frozen_values(self, models: list[dict], shapes: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {n: models[0]["frozen_param_fragments"][n].reshape(-1) for n in shapes}

    def splits_group(self, numels: Sequence[int], sub_group_size: int) -> bool:
        return False

    def write_partition(self, group: FlatGroup, rank: int) -> Partition:
        numels = group.numels
        size = partition.partition_numel(numels, [0] * len(numels), self.world)
        total = sum(numels)
        real = min(size, max(0, total - rank * size))
        return self._saved(group, rank, size, total, real)

    def _saved(self, group: FlatGroup, rank: int, size: int, total: int, real: int) -> Partition:
        pieces = partition.flat_group_pieces(group.names, group.numels, None, rank, size, real)
        return Partition(pieces, real, size - real, moments=size)

    def optimizer_state(self, parts: OptimizerParts) -> dict[str, Any]:
        return {
            "loss_scaler": parts.loss_scaler,
            "dynamic_loss_scale": parts.dynamic,
            "overflow": False,
            "clip_grad": parts.clip_grad,
            self.optimizer_key: parts.optimizer,
            self.masters_key: parts.masters,
            "zero_stage": make(_STAGE_ENUM, self.stage),
            "group_paddings": parts.paddings,
            "param_alignment_paddings": [[0] * n for n in parts.group_sizes],
            "partition_count": [self.world] * len(parts.masters),
            "ds_version": DS_VERSION,
        }

    def module_entry(self, whole: Callable[[], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return whole()

    def frozen_records(
        self, shapes: OrderedDict, whole: Callable[[str], torch.Tensor], rank: int
    ) -> tuple[Optional[OrderedDict], Optional[OrderedDict]]:
        return None, None


class Stage2Layout(Stage1Layout):
    """Stage 2: stage 1's partitions; as gradients are partitioned too, DeepSpeed also records the
    frozen parameters (shapes and whole values) beside the module state_dict."""

    stage = 2

    def frozen_records(
        self, shapes: OrderedDict, whole: Callable[[str], torch.Tensor], rank: int
    ) -> tuple[Optional[OrderedDict], Optional[OrderedDict]]:
        return shapes, OrderedDict((n, whole(n)) for n in shapes)


class Bf16OptimizerLayout(Stage1Layout):
    """DeepSpeed's bf16 optimizer (bf16, stage 1, fp32 gradient accumulation): stage 1's partitions
    saved whole, padding included (the last rank records the group's); no ZeRO stage, no loss
    scaler."""

    def _partition_size(self, saved: int, g: int, rank_state: dict[str, Any]) -> int:
        return saved

    def _saved(self, group: FlatGroup, rank: int, size: int, total: int, real: int) -> Partition:
        padding = size * self.world - total if rank == self.world - 1 else 0
        pieces = partition.flat_group_pieces(group.names, group.numels, None, rank, size, size)
        return Partition(pieces, size, padding, moments=size)

    def optimizer_state(self, parts: OptimizerParts) -> dict[str, Any]:
        return {
            "clip_grad": parts.clip_grad,
            self.optimizer_key: parts.optimizer,
            self.masters_key: parts.masters,
            "group_paddings": parts.paddings,
            "partition_count": [self.world] * len(parts.masters),
            "ds_version": DS_VERSION,
        }


class Stage3Layout:
    """Stage 3: each rank's chunk of every parameter of a (sub-)group, a model states file per rank
    with empty module tensors and its chunks of the frozen parameters."""

    stage = 3
    masters_key = "fp32_flat_groups"
    optimizer_key = "optimizer_state_dict"

    def __init__(self, world: int):
        self.world = world

    def model_files(self) -> list[str]:
        return [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.world)]

    def read_pieces(
        self,
        where: str,
        g: int,
        group: FlatGroup,
        rank: int,
        saved: int,
        rank_state: dict[str, Any],
    ) -> list[Piece]:
        expected = partition.sharded_group_numel(group.numels, self.world)
        partition.check_saved_numel(where, g, rank, expected, saved)
        return partition.sharded_group_pieces(group.names, group.numels, rank, self.world)

    def frozen_values(self, models: list[dict], shapes: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for n, s in shapes.items():
            chunks = [m["frozen_param_fragments"][n].view(-1) for m in models]
            out[n] = torch.cat(chunks)[: math.prod(s)]  # the last rank's chunk is padded
        return out

    def splits_group(self, numels: Sequence[int], sub_group_size: int) -> bool:
        return sum(numels) > sub_group_size

    def write_partition(self, group: FlatGroup, rank: int) -> Partition:
        size = partition.sharded_group_numel(group.numels, self.world)
        pieces = partition.sharded_group_pieces(group.names, group.numels, rank, self.world)
        return Partition(pieces, size, 0, moments=size)

    def optimizer_state(self, parts: OptimizerParts) -> dict[str, Any]:
        return {
            "zero_stage": make(_STAGE_ENUM, 3),
            "loss_scaler": parts.loss_scaler,
            "dynamic_loss_scale": parts.dynamic,
            "overflow": False,
            "partition_count": self.world,
            self.optimizer_key: parts.optimizer,
            self.masters_key: parts.masters,
        }

    def module_entry(self, whole: Callable[[], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype)

    def frozen_records(
        self, shapes: OrderedDict, whole: Callable[[str], torch.Tensor], rank: int
    ) -> tuple[Optional[OrderedDict], Optional[OrderedDict]]:
        return shapes, OrderedDict((n, self._chunk(whole(n), rank)) for n in shapes)

    def _chunk(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s chunk of a parameter, the last one padded with zeros."""
        chunk = partition.chunk_numel(whole.numel(), self.world)
        out = torch.zeros(chunk, dtype=whole.dtype)
        part = whole.view(-1)[rank * chunk : (rank + 1) * chunk]
        out[: part.numel()] = part
        return out


def layout_for(stage: int, bf16_optimizer: bool, world: int) -> DeepSpeedLayout:
    """The layout DeepSpeed writes at ZeRO ``stage`` (1-3) for ``world`` ranks; ``bf16_optimizer``:
    its bf16 optimizer wrote (or is to read) the files, which it does only at stage 1."""
    if bf16_optimizer:
        return Bf16OptimizerLayout(world)
    return {1: Stage1Layout, 2: Stage2Layout, 3: Stage3Layout}[stage](world)
