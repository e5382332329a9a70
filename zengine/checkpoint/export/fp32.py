"""The full fp32 ``state_dict`` from a sharded checkpoint, in one process, with no process group.

Whatever stage and world size saved it, each parameter is assembled from its
pieces in the rank files (the fp32 master of a trained parameter; the saved
value, cast to fp32, of an untrained one); buffers come as saved. Parameters
are produced one at a time, so ``convert_zero_checkpoint_to_fp32_state_dict``
(the ``zengine-to-fp32`` command) holds about one tensor at a time: it
streams each into the output file (a torch file, or safetensors when the name
ends in ``.safetensors``) before assembling the next. Nothing here unpickles: only meta.json (JSON) and
the rank files (raw tensor bytes) are read, never state.pt, so an export runs no code from a checkpoint.

Every function here reads a DeepSpeed 0.19 ZeRO checkpoint too (its ``save_dir``, or one tag's folder),
through deepspeed/reader.py and without DeepSpeed installed: the same tensors DeepSpeed's own
``zero_to_fp32`` gives, and also for the two kinds it skips (frozen parameters at stage 1, the files of its
bf16 optimizer). Its model-states files are pickles: they are read weights-only (tensors and plain
values) unless ``trusted``. Frozen parameters come in fp32 from either kind (DeepSpeed's own tool keeps
them in the training dtype).
"""

from __future__ import annotations

import collections
import json
import math
import os
import secrets
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from ..deepspeed.reader import DeepSpeedReader, is_deepspeed_checkpoint
from ..native import meta as meta_mod
from ..native.holdings import Holding
from ..native.pieces import Piece
from ..native.reader import CheckpointReader, checkpoint_directory
from ..native.tensorfile import TensorFileWriter, TensorSpec
from ..native.torchfile import TorchFileWriter


@dataclass(frozen=True)
class Alias:
    """A state_dict key that is the same tensor as an earlier key (tied parameters)."""

    of: str


def open_checkpoint(checkpoint_dir: str, tag: Optional[str] = None, trusted: bool = False):
    """The reader of one checkpoint: zengine's, or a DeepSpeedReader for a DeepSpeed-written one.

    ``checkpoint_dir`` is a ``save_dir`` (``tag`` default: the one in ``latest``) or one checkpoint's
    folder, of either kind. ``trusted``: a DeepSpeed client_state may hold objects of your own classes
    (only then are its pickles read beyond tensors and plain values)."""
    if tag is None and is_deepspeed_checkpoint(checkpoint_dir):
        directory = checkpoint_dir
    else:
        directory = checkpoint_directory(checkpoint_dir, tag)
    if is_deepspeed_checkpoint(directory):  # no optimizer groups to compare: only weights are read
        return DeepSpeedReader(directory, trusted, [], 1)
    return CheckpointReader(directory)


def kept_rows(meta: dict, exclude_frozen: bool, keys: Optional[set] = None) -> list:
    """meta's state_dict rows ``[key, kind, source]``, less those of untrained parameters when
    ``exclude_frozen`` (a tied name of a trained parameter stays), only ``keys`` when given."""
    rows = meta["state_dict"]
    if keys is not None:
        rows = [r for r in rows if r[0] in keys]
    if not exclude_frozen:
        return rows
    params = meta["params"]
    return [r for r in rows if r[1] != "param" or params[r[2]].get("trained", True)]


def _assemble(
    reader: CheckpointReader, kind: str, source: str, scratch: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """One state_dict entry: a buffer as saved, a parameter in fp32 (in ``scratch`` when given)."""
    if kind == "buffer":
        return reader.read_buffer(source)
    shape = reader.meta["params"][source]["shape"]
    numel = math.prod(shape)
    out = scratch[:numel] if scratch is not None else torch.empty(numel, dtype=torch.float32)
    reader.fill(Holding(out, [Piece(source, 0, numel, 0)]), ("master", "param"))
    return out.view(shape)


def _scratch(reader: CheckpointReader) -> torch.Tensor:
    """One fp32 buffer for the largest parameter, reused for every parameter by the streaming writers
    (so the allocator never has to find room for a new large tensor while the last one is in flight)."""
    largest = max((math.prod(p["shape"]) for p in reader.meta["params"].values()), default=0)
    return torch.empty(largest, dtype=torch.float32)


def _entries(
    reader: CheckpointReader,
    scratch: Optional[torch.Tensor] = None,
    exclude_frozen: bool = False,
    keys: Optional[set] = None,
) -> Iterator[tuple[str, Union[torch.Tensor, Alias]]]:
    """(key, tensor or Alias) in state_dict order; with ``scratch``, each parameter is valid only until the next."""
    first: dict[str, str] = {}
    for key, kind, source in kept_rows(reader.meta, exclude_frozen, keys):
        if (kind, source) in first:
            yield key, Alias(first[(kind, source)])
        else:
            first[(kind, source)] = key
            yield key, _assemble(reader, kind, source, scratch)


def iter_fp32_state_dict(
    checkpoint_dir: str,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    trusted: bool = False,
) -> Iterator[tuple[str, Union[torch.Tensor, Alias]]]:
    """(key, fp32 tensor) in the model's state_dict order, one at a time; a tied key yields an Alias."""
    with open_checkpoint(checkpoint_dir, tag, trusted) as reader:
        yield from _entries(reader, exclude_frozen=exclude_frozen_parameters)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    trusted: bool = False,
) -> "collections.OrderedDict[str, torch.Tensor]":
    """The model's full fp32 state_dict from a sharded checkpoint (any stage, any world size), zengine's
    or DeepSpeed's.

    ``checkpoint_dir`` is the ``save_dir`` of ``engine.save_checkpoint`` (``tag`` default: the one in
    ``latest``) or a checkpoint directory itself. Tied parameters share one tensor, as in the model.
    ``exclude_frozen_parameters``: leave out the parameters that were not trained.
    """
    out: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    for key, value in iter_fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters, trusted):
        out[key] = out[value.of] if isinstance(value, Alias) else value
    return out


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str, tag: Optional[str] = None
):
    """Load the fp32 weights of a checkpoint into a plain (unwrapped) ``model`` on the CPU; returns the model.

    Strict, unlike DeepSpeed's (``strict=False``): a key the checkpoint lacks or the model lacks is named
    rather than left at the model's initial value."""
    model = model.cpu()
    model.load_state_dict(
        get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=True
    )
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_file: str,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    dtype: Optional[torch.dtype] = None,
    keys: Optional[set] = None,
) -> None:
    """Write the fp32 state_dict to ``output_file``, streaming one tensor at a time.

    ``*.safetensors``: the safetensors format, each tied weight once, its aliases in the metadata (as Hugging
    Face's ``save_pretrained``; ``load_safetensors_state_dict`` gives every key back); anything else: a
    ``torch.save`` file (tied keys share one storage). The file
    appears under its name only once complete. ``dtype``: floating-point tensors are written in it
    (DeepSpeed's ``zero_to_torch.py --dtype``), integer and boolean buffers keep theirs; None:
    parameters in fp32, buffers as saved. ``keys``: only these (one shard: shards.py).
    """
    tmp = f"{output_file}.tmp-{secrets.token_hex(4)}"
    try:
        with open_checkpoint(checkpoint_dir, tag) as reader:
            if output_file.endswith(".safetensors"):
                write_safetensors(reader, tmp, exclude_frozen_parameters, dtype, keys)
            else:
                _write_torch(reader, tmp, exclude_frozen_parameters, dtype, keys)
        os.replace(tmp, output_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _cast(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.dtype.is_floating_point else tensor


def _write_torch(
    reader: CheckpointReader,
    path: str,
    exclude_frozen: bool,
    dtype: Optional[torch.dtype],
    keys: Optional[set],
) -> None:
    writer = TorchFileWriter(path)
    try:
        for key, value in _entries(reader, _scratch(reader), exclude_frozen, keys):
            if isinstance(value, Alias):
                writer.alias(key, value.of)
            else:
                writer.write(key, _cast(value, dtype))
        writer.close()
    except BaseException:
        writer.abort()
        raise


TIED_KEY = "tied"  # safetensors metadata: {alias: stored name} of the tied weights written once


def write_safetensors(
    reader,
    path: str,
    exclude_frozen: bool = False,
    dtype: Optional[torch.dtype] = None,
    keys: Optional[set] = None,
) -> dict[str, str]:
    """The fp32 model in ``reader``'s checkpoint to ``path`` as safetensors, streamed one tensor at a time,
    each tied weight once (safetensors has no shared tensors: as Hugging Face's ``save_pretrained``, the first
    name is stored and the aliases are recorded in the metadata under ``TIED_KEY``). Returns the aliases.
    ``dtype``: floating-point tensors are written in it (None: parameters in fp32, buffers as saved)."""
    meta = reader.meta
    first: dict[tuple[str, str], str] = {}
    specs, tied = [], {}
    for key, kind, source in kept_rows(meta, exclude_frozen, keys):
        if (kind, source) in first:
            tied[key] = first[(kind, source)]
            continue
        first[(kind, source)] = key
        entry = meta["params" if kind == "param" else "buffers"][source]
        saved = torch.float32 if kind == "param" else meta_mod.dtype_of(entry["dtype"])
        specs.append(
            TensorSpec(key, _cast(torch.empty(0, dtype=saved), dtype).dtype, tuple(entry["shape"]))
        )
    writer = TensorFileWriter(
        path, specs, plain_metadata={"format": "pt", TIED_KEY: json.dumps(tied)}
    )
    try:
        for key, value in _entries(reader, _scratch(reader), exclude_frozen, keys):
            if not isinstance(value, Alias):
                writer.write(key, _cast(value, dtype))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return tied
