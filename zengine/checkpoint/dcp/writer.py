"""Writing DCP's files from boxes of tensors and plain values, through DCP's own writer and planner.

``DcpWrite`` is one save, split where a background save needs it split (torch's ``dcp.save`` does the
same steps in one call, with collectives at both ends):

    plan()      every rank: its write items (one per box, one per value) -> gathered -> DCP's global
                plan and metadata (``create_default_global_save_plan``, which also checks that the
                boxes of each tensor cover it without overlap) -> this rank's file prefix
    write()     every rank: its ``__<rank>_0.distcp`` through ``FileSystemWriter`` (no collective)
    finish()    the coordinator: ``.metadata`` from every rank's write results (DCP renames it into
                place last: a folder without it is a save that did not finish)

The gathers are the caller's (a process group's all_gather, or nothing offline), so the write can run
on a background thread while the training collectives go on (native/background.py).
"""

from __future__ import annotations

import io
from typing import Any, Callable, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from .boxes import Box


class DcpEntry(NamedTuple):
    """Box ``box`` of the tensor ``fqn`` of shape ``shape``: ``tensor`` holds it (shaped ``box.sizes``)."""

    fqn: str
    shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor


class _Boxes(SavePlanner):
    """A SavePlanner of given boxes and values, not of a state_dict's tensors: zengine's pieces become
    DCP chunks (``boxes.flat_boxes``); DCP's helpers build the global plan and metadata."""

    def __init__(self, entries: list[DcpEntry], values: dict[str, Any]):
        self.entries = {(e.fqn, tuple(e.box.offsets)): e for e in entries}
        self.values = values

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items = []
        for (fqn, offsets), e in self.entries.items():
            whole = e.box.sizes == tuple(e.shape)
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)),
                    type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(e.box.sizes)),
                        properties=TensorProperties(dtype=e.tensor.dtype),
                        size=torch.Size(e.shape),
                    ),
                )
            )
        items += [
            WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.values
        ]
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.values[index.fqn], buf)
            buf.seek(0)
            return buf
        return self.entries[(index.fqn, tuple(index.offset))].tensor.contiguous()


class DcpWrite:
    """One DCP save of this rank's ``entries`` and ``values`` into ``directory`` (see the module doc)."""

    def __init__(
        self,
        directory: str,
        entries: list[DcpEntry],
        values: dict[str, Any],
        rank: int,
    ):
        self.rank = rank
        self.planner = _Boxes(entries, values)
        self.writer = FileSystemWriter(directory, sync_files=True, thread_count=1)
        self.writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)

    def plan(self, gather: Callable[[SavePlan], list[SavePlan]]) -> None:
        """Agree on the global plan: ``gather`` returns every rank's local plan, by rank."""
        local = self.writer.prepare_local_plan(self.planner.create_local_plan())
        plans, self.metadata = self.planner.create_global_plan(gather(local))
        plans = self.writer.prepare_global_plan(plans)
        self.mine = self.planner.finish_plan(plans[self.rank])

    def write(self) -> list:
        """This rank's file; its write results (for ``finish``)."""
        return self.writer.write_data(self.mine, self.planner).wait()

    def finish(self, results: list[list]) -> None:
        """The coordinator: ``.metadata`` from every rank's write results."""
        self.writer.finish(self.metadata, results)


def write_offline(directory: str, entries: list[DcpEntry], values: dict[str, Any]) -> None:
    """A whole DCP checkpoint from one process (zengine-convert to-dcp)."""
    save = DcpWrite(directory, entries, values, 0)
    save.plan(lambda local: [local])
    save.finish([save.write()])
