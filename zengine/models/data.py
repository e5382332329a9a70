"""Byte-level text for the examples: the repository's own files, or generated text.

No download: the corpus is README.md and the ``*.py`` files under ``zengine/``,
found relative to this package. Where they are missing or too short (an
installed copy without the sources, say), a seeded generator writes plain
English-like sentences instead. Either way the same inputs give the same bytes,
so every rank and every run sees the same data.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../zengine
REPO_DIR = PACKAGE_DIR.parent
MIN_CORPUS_BYTES = 16 * 1024


def source_files(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """README.md beside the package (if present) and every ``*.py`` under it, in a fixed order."""
    files = sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    readme = package_dir.parent / "README.md"
    return ([readme] if readme.is_file() else []) + files


_SUBJECTS = (
    "the engine",
    "each rank",
    "the optimizer",
    "a shard",
    "the gradient",
    "the launcher",
    "every bucket",
    "the master copy",
    "the scheduler",
    "a worker",
)
_VERBS = (
    "reduces",
    "gathers",
    "holds",
    "updates",
    "splits",
    "sends",
    "keeps",
    "checks",
    "writes",
    "reads",
)
_OBJECTS = (
    "its slice",
    "the flat buffer",
    "the loss",
    "one step",
    "the parameters",
    "a checkpoint",
    "the learning rate",
    "the batch",
    "its state",
    "the norm",
)
_TAILS = (
    "",
    " before the step",
    " after backward",
    " on every rank",
    " in one pass",
    " at the boundary",
)


def generated_text(num_bytes: int, seed: int = 0) -> bytes:
    """About ``num_bytes`` of simple sentences from a seeded grammar (same seed, same text)."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < num_bytes:
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
            f"{rng.choice(_TAILS)}."
        ).capitalize()
        sentence += "\n" if rng.random() < 0.2 else " "
        out.append(sentence)
        size += len(sentence)
    return "".join(out).encode("ascii")


def load_corpus(files: Optional[Sequence[Path]] = None, min_bytes: int = MIN_CORPUS_BYTES) -> bytes:
    """The bytes of ``files`` (default :func:`source_files`) joined, or generated text when they
    hold fewer than ``min_bytes``."""
    files = source_files() if files is None else files
    data = b"\n".join(Path(f).read_bytes() for f in files)
    return data if len(data) >= min_bytes else generated_text(max(min_bytes, 256 * 1024))


class ByteWindows(Dataset):
    """Windows of a byte string: item ``i`` is ``(x, y)``, each ``[seq_len]`` int64, y = x shifted by one.

    Windows start every ``stride`` bytes (default ``seq_len``, so they do not overlap).
    """

    vocab_size = 256

    def __init__(self, seq_len: int, data: Optional[bytes] = None, stride: Optional[int] = None):
        data = load_corpus() if data is None else data
        if len(data) < seq_len + 1:
            raise ValueError(
                f"ByteWindows: {len(data)} bytes cannot fill one window of {seq_len} + 1"
            )
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # [num_bytes]
        self.num_windows = (len(data) - seq_len - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_windows:
            raise IndexError(i)
        start = i * self.stride
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]
