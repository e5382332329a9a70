"""DCP's files read through DCP's own reader and planner, for the boxes and values zengine asks.

``DcpFiles(directory)`` opens a DCP folder with torch's ``FileSystemReader``; ``read(boxes, values)`` is one
``torch.distributed.checkpoint.load`` of exactly those: tensors as boxes of rows (``boxes.py``), resharded by
DCP's planner helpers from whatever chunks the saving ranks wrote, and non-tensor values. It runs without a
collective (``no_dist``): each rank asks its own boxes.

Loading runs no code from the files unless trusted: ``.metadata`` is a pickle of DCP's dataclasses,
unpickled here with only those classes (and torch's dtypes, sizes, layouts) allowed; values are
``torch.load(..., weights_only=True)``. A missing, truncated or corrupt file, or a folder without
``.metadata``, raises CheckpointFileError naming it.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import CheckpointFileError, CheckpointUntrustedError
from . import METADATA
from .boxes import Box

# what DCP's .metadata pickle may name: its own dataclasses, torch's value types
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Only the classes a DCP ``.metadata`` holds (Python's documented way to restrict a pickle)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


class _SafeReader(FileSystemReader):
    """torch's FileSystemReader, its ``.metadata`` unpickled with DCP's classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), METADATA)
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        metadata.storage_meta = None
        return metadata


class _Requests(LoadPlanner):
    """A LoadPlanner for the boxes and values zengine asks, not a state_dict's: DCP's planner helpers
    find the saved chunks each box overlaps (any saving world size), and DCP's reader reads them."""

    def __init__(
        self, boxes: dict[str, list[tuple[Box, torch.Tensor]]], values: list[str], trusted
    ):
        self.boxes, self.values, self.trusted = boxes, values, trusted
        self.loaded: dict[str, Any] = {}
        self.refused: Optional[str] = (
            None  # a value a weights-only load refused (torch wraps the error)
        )

    def set_up_planner(self, state_dict, metadata: Optional[Metadata] = None, is_coordinator=False):
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn, wanted in self.boxes.items():
            chunks = [
                ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b, _ in wanted
            ]
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], chunks
            )
        for fqn in self.values:
            index = MetadataIndex(fqn)
            zero = torch.Size((0,))
            items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.loaded[fqn] = torch.load(value, weights_only=not self.trusted)
        except pickle.UnpicklingError as e:
            self.refused = (
                f"DCP value {fqn!r} holds objects a weights-only load refuses ({_first_line(e)})"
            )
            raise

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        _, dest = self.boxes[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (at, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, at, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: already in place


class DcpFiles:
    """One DCP folder: its metadata, and reads of boxes and values from it."""

    def __init__(self, directory: str, trusted: bool = False):
        self.directory, self.trusted = directory, trusted
        path = os.path.join(directory, METADATA)
        if not os.path.isfile(path):
            raise CheckpointFileError(
                f"DCP checkpoint file {path} is missing: the save that wrote {directory} did not "
                "finish (DCP writes .metadata last), or the folder is not a DCP checkpoint"
            )
        self._reader = _SafeReader(directory)
        try:
            self.metadata = self._reader.read_metadata()
            self.metadata.state_dict_metadata  # a pickle of something else fails here
        except Exception as e:
            raise CheckpointFileError(
                f"DCP checkpoint file {path} is corrupt or not DCP's ({type(e).__name__}: {e})"
            ) from None
        self._check_files()

    def _check_files(self) -> None:
        """Every data file the metadata names is there and long enough (no data read)."""
        ends: dict[str, int] = {}
        for info in (self.metadata.storage_data or {}).values():
            name = str(info.relative_path)
            ends[name] = max(ends.get(name, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            path = os.path.join(self.directory, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                raise CheckpointFileError(f"DCP checkpoint file {path} is missing") from None
            if size < end:
                raise CheckpointFileError(
                    f"DCP checkpoint file {path} is {size} bytes, its metadata needs {end}: "
                    "it is truncated"
                )

    @property
    def tensors(self) -> dict[str, TensorStorageMetadata]:
        return {
            k: v
            for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }

    @property
    def values(self) -> set[str]:
        return {
            k
            for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)
        }

    def read(
        self, boxes: dict[str, list[tuple[Box, torch.Tensor]]], values: list[str] = ()
    ) -> dict[str, Any]:
        """Fill each destination tensor with its box of the saved tensor ``fqn``; return the values asked."""
        if not boxes and not values:
            return {}
        planner = _Requests(boxes, list(values), self.trusted)
        try:
            with warnings.catch_warnings():  # no_dist is meant: each rank reads its own boxes
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
        except Exception as e:  # torch wraps a rank's failure: the files are named in the message
            if planner.refused:
                raise CheckpointUntrustedError(
                    f"DCP checkpoint {self.directory}: {planner.refused}; nothing of it ran. If you "
                    "trust where it comes from, load_checkpoint(..., trust_client_state=True)"
                ) from None
            raise CheckpointFileError(
                f"DCP checkpoint {self.directory} could not be read ({type(e).__name__}: "
                f"{_first_line(e)}); a file is corrupt or truncated"
            ) from None
        return planner.loaded


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""
