"""Reading a checkpoint directory piece by piece: for loading into an engine and for the offline export.

``CheckpointReader(directory)`` reads and checks ``meta.json`` (every listed
file present with its recorded size), opens a rank file only when a piece is
first needed from it, and fills a ``Holding`` from whichever saved pieces
overlap its pieces, whatever the layout that wrote them. Every byte read is
verified against its block checksum (tensorfile.py).
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Optional, Sequence

import torch

from . import atomic, meta as meta_mod
from ..errors import CheckpointFileError
from .holdings import Holding
from .pieces import overlaps
from .safe_load import load_state
from .tensorfile import TensorFileReader


def checkpoint_directory(checkpoint_dir: str, tag: Optional[str] = None) -> str:
    """The directory of one checkpoint: ``checkpoint_dir/tag`` (tag default: ``latest``), or
    ``checkpoint_dir`` itself when it is a checkpoint directory. CheckpointNotFoundError (a
    FileNotFoundError) when there is none."""
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, meta_mod.META)):
        return checkpoint_dir
    return atomic.find(checkpoint_dir, tag)


class CheckpointReader:
    """One checkpoint directory, its meta and its lazily opened rank files."""

    def __init__(self, directory: str):
        self.directory = directory
        self.meta = meta_mod.read_meta(directory)
        meta_mod.check_files(directory, self.meta)
        self._files: dict[int, TensorFileReader] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def file(self, rank: int) -> TensorFileReader:
        if rank not in self._files:
            name = meta_mod.rank_file(rank)
            path = os.path.join(self.directory, name)
            self._files[rank] = TensorFileReader(path, meta_mod.file_info(self.meta, name))
        return self._files[rank]

    def fill(self, holding: Holding, kinds: Sequence[str], required: bool = True) -> None:
        """Fill each piece of ``holding`` from saved entries ``<kind>/<name>`` (the first kind a file has).

        ``required``: every element must be found (a master, a parameter); else a piece not wholly
        found is zeroed first (optimizer state of a parameter that was frozen when the checkpoint was saved).
        """
        for piece in holding.pieces:
            sources = []
            for rank, lo, hi, at in overlaps(piece, self.meta["pieces"].get(piece.name, [])):
                f = self.file(rank)
                key = next((k for k in (f"{kind}/{piece.name}" for kind in kinds) if k in f), None)
                if key is not None:
                    sources.append((f, key, lo, hi, at))
            found = sum(hi - lo for _, _, lo, hi, _ in sources)
            if found != piece.numel:
                if required:
                    raise CheckpointFileError(
                        f"checkpoint {self.directory} holds {found} of the {piece.numel} "
                        f"elements [{piece.start}, {piece.end}) of {piece.name}"
                    )
                holding.view(piece).zero_()
            for f, key, lo, hi, at in sources:
                f.read_into(key, lo, hi, holding.view(piece).narrow(0, at, hi - lo))

    def buffer_into(self, name: str, dst: torch.Tensor) -> None:
        """Buffers are saved whole by rank 0."""
        self.file(0).read_into(f"buffer/{name}", 0, dst.numel(), dst.view(-1))

    def read_buffer(self, name: str) -> torch.Tensor:
        return self.file(0).read(f"buffer/{name}")

    def read_state(self, trusted: bool = False) -> dict[str, Any]:
        """state.pt, verified against its size and checksum in meta.json, then loaded weights-only: tensors and
        plain values, never code (CheckpointUntrustedError otherwise). ``trusted``: any pickled object, as
        ``torch.load(..., weights_only=False)`` (the checksum proves integrity, not origin)."""
        path = os.path.join(self.directory, meta_mod.STATE)
        entry = self.meta["files"][meta_mod.STATE]
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) != entry["size"] or zlib.crc32(raw) != entry["crc"]:
            raise CheckpointFileError(
                f"checkpoint file {path} fails its checksum (corrupt or truncated)"
            )
        return load_state(raw, path, trusted)
