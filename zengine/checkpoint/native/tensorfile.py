"""Tensor files: the safetensors layout, written and read in bounded chunks, with checksums.

A file is an 8-byte little-endian header length, a JSON header, then the raw
bytes of every tensor end to end: the safetensors format, so that
``safetensors.safe_open`` reads our files too. The header's ``__metadata__``
holds our own records as JSON strings: the CRC-32 of each ``BLOCK`` bytes of
every tensor (so that a reader verifies exactly the blocks it reads, never the
whole file) and whatever the caller keeps there (a checkpoint's piece index).

Writing streams. The header is laid out first with checksum placeholders of
fixed width, the tensors follow one chunk at a time (a device tensor is copied
to the host one chunk at a time), and the header is rewritten in place with
the checksums; the file is fsynced on close. Reading uses ranged reads
(seek + readinto) into a buffer of at most ``CHUNK`` bytes, so a reader holds
no more than one chunk beyond the tensor it fills, and nothing stays mapped.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from ..errors import CheckpointFileError

BLOCK = 4 << 20  # bytes covered by one checksum
CHUNK = 16 << 20  # bytes moved per read or write call (a multiple of BLOCK)

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}
_CRC_KEY, _USER_KEY = "zengine.crc32", "zengine.meta"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: its key, dtype and shape (known before any byte is written)."""

    key: str
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class FileInfo:
    """What a reader checks a file against: its size and the CRC-32 of its header."""

    size: int
    header_crc: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's elements (a copy only when it is not contiguous)."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy. Not ``Tensor.numpy()``: that marks the
    storage as not resizable for good, and stage 3 resizes parameter storage to free it."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


class TensorFileWriter:
    """Writes the tensors of ``specs``, in that order, to ``path``; ``close()`` returns the FileInfo."""

    def __init__(
        self,
        path: str,
        specs: Sequence[TensorSpec],
        metadata: Optional[dict[str, Any]] = None,
        plain_metadata: Optional[dict[str, str]] = None,
    ):
        for spec in specs:
            if spec.dtype not in DTYPES:
                raise TypeError(f"{path}: cannot store {spec.key} of dtype {spec.dtype}")
        self.path = path
        self.specs = list(specs)
        self.metadata = metadata or {}
        self.plain_metadata = (
            plain_metadata or {}
        )  # string pairs for other readers ({"format": "pt"})
        self._next = 0
        self._crcs: dict[str, list[int]] = {}
        offsets, end = {}, 0
        for spec in self.specs:
            offsets[spec.key] = (end, end + spec.nbytes)
            end += spec.nbytes
        self._offsets = offsets
        self._file = open(path, "wb")
        header = self._header()
        self._header_len = len(header)
        self._file.write(header)

    def _header(self) -> bytes:
        crcs = {
            s.key: ",".join(f"{c:08x}" for c in self._crcs.get(s.key, [0] * _blocks(s.nbytes)))
            for s in self.specs
        }
        body = {
            "__metadata__": {
                **self.plain_metadata,
                _CRC_KEY: json.dumps(crcs),
                _USER_KEY: json.dumps(self.metadata),
            }
        }
        for s in self.specs:
            body[s.key] = {
                "dtype": DTYPES[s.dtype],
                "shape": list(s.shape),
                "data_offsets": list(self._offsets[s.key]),
            }
        raw = json.dumps(body, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        return struct.pack("<Q", len(raw)) + raw

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (it must be the next spec's key, dtype and numel)."""
        spec = self.specs[self._next]
        if key != spec.key or tensor.dtype != spec.dtype or tensor.numel() != math.prod(spec.shape):
            raise ValueError(
                f"{self.path}: expected {spec.key} {spec.dtype} {spec.shape}, got {key} "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
        data = _as_bytes(tensor)
        crcs = []
        for lo in range(0, data.numel(), CHUNK):
            chunk = data[lo : lo + CHUNK].cpu()  # a view when on the host already
            host = _host_bytes(chunk)
            write_bytes(self._file, host)
            crcs.extend(zlib.crc32(host[b : b + BLOCK]) for b in range(0, len(host), BLOCK))
        self._crcs[key] = crcs
        self._next += 1

    def close(self) -> FileInfo:
        """Rewrite the header with the checksums, fsync and close; the file's size and header CRC."""
        if self._next != len(self.specs):
            raise ValueError(
                f"{self.path}: {len(self.specs) - self._next} tensors were not written"
            )
        header = self._header()
        assert len(header) == self._header_len, "checksums are fixed width"
        self._file.seek(0)
        self._file.write(header)
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.seek(0, os.SEEK_END)
        self._file.close()
        return FileInfo(size, zlib.crc32(header))

    def abort(self) -> None:
        """Close without finishing (the caller removes the file)."""
        self._file.close()


def write_bytes(f, data) -> None:
    """Write a buffer to an open file (the one place bytes go to disk; tests patch it)."""
    f.write(data)


def write_tensor_file(
    path: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: Optional[dict[str, Any]] = None,
) -> FileInfo:
    """Write (key, tensor) pairs to ``path``; the tensors are views, nothing is gathered or copied whole."""
    tensors = list(tensors)
    writer = TensorFileWriter(
        path, [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors], metadata
    )
    try:
        for key, t in tensors:
            writer.write(key, t)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _read_exact(f, view: memoryview) -> int:
    """Fill ``view`` from ``f``; fewer bytes only at the end of the file."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK)


class TensorFileReader:
    """Ranged, verified reads from a tensor file.

    With ``expect`` (a FileInfo from the checkpoint's meta) the size and the
    header's checksum are checked on open; every block read is checked
    against its CRC-32. Any mismatch raises CheckpointFileError naming the file.
    """

    def __init__(self, path: str, expect: Optional[FileInfo] = None):
        self.path = path
        try:
            self._file = open(path, "rb", buffering=0)  # ranged reads go straight into our buffer
        except OSError as e:
            raise CheckpointFileError(f"checkpoint file {path} cannot be opened: {e}") from e
        size = os.fstat(self._file.fileno()).st_size
        if expect is not None and size != expect.size:
            self.close()
            raise CheckpointFileError(
                f"checkpoint file {path} is {size} bytes but was written with {expect.size}: "
                f"it is truncated or was modified"
            )
        raw_len = self._file.read(8)
        (header_len,) = struct.unpack("<Q", raw_len) if len(raw_len) == 8 else (size,)
        if header_len > size - 8:
            self.close()
            raise CheckpointFileError(
                f"checkpoint file {path} is not a tensor file or is truncated"
            )
        header = self._file.read(header_len)
        if expect is not None and zlib.crc32(raw_len + header) != expect.header_crc:
            self.close()
            raise CheckpointFileError(
                f"checkpoint file {path}: its header fails its checksum (corrupt)"
            )
        try:
            body = json.loads(header)
        except ValueError as e:
            self.close()
            raise CheckpointFileError(f"checkpoint file {path}: unreadable header ({e})") from e
        meta = body.pop("__metadata__", {}) or {}
        self.metadata: dict[str, Any] = json.loads(meta.get(_USER_KEY, "{}"))
        crcs = json.loads(meta.get(_CRC_KEY, "{}"))
        self._data_start = 8 + header_len
        self.entries = {
            k: (DTYPE_OF[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
            for k, v in body.items()
        }
        self._crcs = {k: [int(c, 16) for c in v.split(",") if c] for k, v in crcs.items()}
        last = max((e[3] for e in self.entries.values()), default=0)
        if self._data_start + last > size:
            self.close()
            raise CheckpointFileError(
                f"checkpoint file {path} is truncated: {size} bytes, its header describes "
                f"{self._data_start + last}"
            )

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def spec(self, key: str) -> TensorSpec:
        dtype, shape, _, _ = self.entries[key]
        return TensorSpec(key, dtype, shape)

    def read_into(self, key: str, lo: int, hi: int, dst: torch.Tensor) -> None:
        """Copy elements [lo, hi) of the flattened tensor ``key`` into the 1-D ``dst`` (cast and moved as needed).

        Reads whole checksum blocks, at most CHUNK bytes at a time, and verifies each. Blocks that lie
        wholly inside the range go straight into ``dst`` when it is a contiguous host tensor of the
        stored dtype; the rest (partial blocks at the ends, a cast, a device) pass through a scratch buffer.
        """
        dtype, _, begin, end = self.entries[key]
        item, nbytes = _itemsize(dtype), end - begin
        want_lo, want_hi = lo * item, hi * item
        if want_hi > nbytes or hi < lo or dst.numel() != hi - lo:
            raise ValueError(
                f"{self.path}: {key}[{lo}:{hi}] is out of range or does not fit {tuple(dst.shape)}"
            )
        direct = (
            dst.device.type == "cpu"
            and dst.dtype == dtype
            and dst.is_contiguous()
            and dst.dim() == 1
        )
        dst_bytes = dst.view(torch.uint8) if direct and dtype != torch.uint8 else dst
        inner_end = (
            want_hi if want_hi == nbytes else (want_hi // BLOCK) * BLOCK
        )  # whole blocks end here
        last = min(-(-want_hi // BLOCK) * BLOCK, nbytes)  # the end of the last block needed
        pos = (want_lo // BLOCK) * BLOCK
        while pos < want_hi:
            if direct and want_lo <= pos < inner_end:
                stop = min(pos + CHUNK, inner_end)
                self._read_verified(key, pos, dst_bytes[pos - want_lo : stop - want_lo])
            else:
                stop = min(pos + (BLOCK if direct else CHUNK), last)
                scratch = torch.empty(
                    stop - pos, dtype=torch.uint8
                )  # not zero-filled: it is read over
                self._read_verified(key, pos, scratch)
                a, b = max(want_lo, pos), min(want_hi, stop)
                out = (a - want_lo) // item
                dst[out : out + (b - a) // item].copy_(scratch[a - pos : b - pos].view(dtype))
            pos = stop

    def _read_verified(self, key: str, pos: int, target: torch.Tensor) -> None:
        """Read bytes [pos, pos + len) of ``key``'s data (block-aligned) into the uint8 host tensor ``target``."""
        _, _, begin, _ = self.entries[key]
        view = _host_bytes(target)
        self._file.seek(self._data_start + begin + pos)
        if _read_exact(self._file, view) != len(view):
            raise CheckpointFileError(f"checkpoint file {self.path} is truncated inside {key}")
        crcs = self._crcs.get(key)
        if crcs is None:
            return
        for b in range(0, len(view), BLOCK):
            block = (pos + b) // BLOCK
            if block >= len(crcs) or zlib.crc32(view[b : b + BLOCK]) != crcs[block]:
                raise CheckpointFileError(
                    f"checkpoint file {self.path}: {key} fails its checksum at byte "
                    f"{pos + b} (corrupt)"
                )

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, on the CPU."""
        dtype, shape, _, _ = self.entries[key]
        out = torch.empty(math.prod(shape), dtype=dtype)
        self.read_into(key, 0, out.numel(), out)
        return out.view(shape)

    def close(self) -> None:
        self._file.close()
