"""A ``torch.save``-compatible file of a flat dict of tensors, written one tensor at a time.

``torch.save`` pickles the whole object first and so needs every tensor in
memory at once. This writer puts each tensor's bytes into the zip archive as
it arrives (record ``data/<n>``, as torch names them) and pickles the dict at
the end, with references to the records already written. ``torch.load``
(``mmap=True`` and ``weights_only=True`` included) reads the result like any
file ``torch.save`` wrote.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys

import torch


class _StorageRef:
    """Stands for a storage already written as record ``data/<key>``."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as the tensor ``torch.load`` rebuilds from a storage record."""

    def __init__(self, storage: _StorageRef, shape: tuple):
        self.storage, self.shape = storage, tuple(shape)

    def __reduce_ex__(self, protocol):
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.insert(0, step)
            step *= max(size, 1)
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, 0, self.shape, tuple(stride), False, collections.OrderedDict()),
        )


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class TorchFileWriter:
    """``write(key, tensor)`` one tensor at a time (``alias(key, other)`` for a tied one); ``close()`` finishes."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "wb")
        self._zip = torch._C.PyTorchFileWriter(self._file)
        self._entries: dict[str, _TensorRef] = collections.OrderedDict()

    def write(self, key: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        start = t.storage_offset() * t.element_size()
        # A view into a larger storage (a flat parameter buffer, a reused scratch): its own bytes only.
        storage = t.untyped_storage()[start : start + nbytes]
        ref = _StorageRef(str(len(self._entries)), t.dtype, t.numel())
        self._zip.write_record(f"data/{ref.key}", storage, nbytes)
        self._entries[key] = _TensorRef(ref, t.shape)

    def alias(self, key: str, other: str) -> None:
        """``key`` is the same tensor as the already written ``other`` (tied parameters)."""
        self._entries[key] = self._entries[other]

    def close(self) -> None:
        """Write the pickled dict and the archive's records, fsync and close."""
        buf = _pickle_bytes(self._entries)
        self._zip.write_record("data.pkl", buf, len(buf))
        self._zip.write_record(".format_version", "1", 1)
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._zip.write_end_of_file()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()


def _pickle_bytes(entries) -> bytes:
    import io

    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(collections.OrderedDict(entries))
    return out.getvalue()
