"""``meta.json``: what a checkpoint holds, described without any layout.

Written by rank 0 last, after every rank's file is on disk, so a checkpoint
directory with a valid ``meta.json`` is complete. It names every parameter
(shape, dtype, whether it was trained, and so has an fp32 master) and every
buffer, lists the model's ``state_dict`` keys (tied parameters point at one
source), records the engine's counters, the size and header checksum of each
file, and the piece index: for each parameter, which rank file holds which
elements. A loader reads it first and opens only the files it needs.

meta.json checks itself: ``meta_crc`` is the CRC-32 of the rest of its
content in canonical JSON (sorted keys, no spaces), so an edited value (say
``global_steps``) is refused by name, while the file's layout may change.
Version 1 (before the checksum) is still read, with a warning.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch
from torch import nn

from ...log import logger
from ...zero.stage3.param import lookup
from ..errors import CheckpointFileError, CheckpointMismatchError
from .tensorfile import FileInfo

FORMAT = "zengine-checkpoint"
VERSION = 2  # 2: meta.json carries its own checksum
META = "meta.json"
CHECKSUM = "meta_crc"
STATE = "state.pt"  # rank 0: optimizer hyper-parameters and scalars, scheduler, scaler, RNG, client_state


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def describe_model(
    module: nn.Module, trained_names: set[str], excluded: frozenset = frozenset()
) -> dict[str, Any]:
    """Parameters (name -> shape, dtype, trained), persistent buffers, and the state_dict keys in order;
    the parameters named in ``excluded`` (left out of the checkpoint) are not described.

    Stage-3 parameters show an empty tensor when released: their shape and dtype come from their ShardedParam.
    """
    params = {}
    for name, p in module.named_parameters():
        if name in excluded:
            continue
        sp = lookup(p)
        shape, dtype = (sp.shape, sp.full.dtype) if sp is not None else (tuple(p.shape), p.dtype)
        params[name] = {
            "shape": list(shape),
            "dtype": dtype_name(dtype),
            "trained": name in trained_names,
        }
    param_names = {id(p): n for n, p in module.named_parameters()}
    buffer_names = {id(b): n for n, b in module.named_buffers()}
    buffers, keys = {}, []
    for prefix, m in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for n, p in m._parameters.items():
            if p is not None and param_names[id(p)] not in excluded:
                keys.append([pre + n, "param", param_names[id(p)]])
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                source = buffer_names[id(b)]
                buffers[source] = {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
                keys.append([pre + n, "buffer", source])
    return {"params": params, "buffers": buffers, "state_dict": keys}


def check_same_model(
    meta: dict[str, Any], model: dict[str, Any], where: str, strict: bool = True
) -> set[str]:
    """Raise CheckpointMismatchError listing every parameter or buffer that is missing, extra, or reshaped.
    Not ``strict`` (DeepSpeed's ``load_module_strict=False``): only a reshaped one raises; returns the names of
    the model's parameters and buffers the checkpoint lacks (the caller leaves them as they are)."""
    problems, lacking = [], set()
    for kind in ("params", "buffers"):
        saved, ours = meta[kind], model[kind]
        label = "parameter" if kind == "params" else "buffer"
        missing = [n for n in ours if n not in saved]
        extra = [n for n in saved if n not in ours]
        lacking.update(missing)
        if not strict:
            missing = extra = []
        if missing:
            problems.append(
                f"{label}s of the model missing from the checkpoint: {', '.join(missing)}"
            )
        if extra:
            problems.append(
                f"{label}s in the checkpoint that the model does not have: {', '.join(extra)}"
            )
        for n in ours:
            if n in saved and list(saved[n]["shape"]) != list(ours[n]["shape"]):
                problems.append(
                    f"{label} {n}: shape {tuple(saved[n]['shape'])} in the checkpoint, "
                    f"{tuple(ours[n]['shape'])} in the model"
                )
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {where} was saved from a different model:\n  " + "\n  ".join(problems)
        )
    return lacking


def file_info(meta: dict[str, Any], name: str) -> FileInfo:
    entry = meta["files"][name]
    return FileInfo(entry["size"], entry["crc"])


def _checksum(meta: dict[str, Any]) -> int:
    """CRC-32 of ``meta`` without its checksum, in canonical JSON (what json.load gives back hashes the same)."""
    body = {k: v for k, v in meta.items() if k != CHECKSUM}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    path = os.path.join(directory, META)
    meta = json.loads(json.dumps(meta))  # tuples to lists, as a reader will see them
    meta[CHECKSUM] = _checksum(meta)
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_meta(directory: str) -> dict[str, Any]:
    """The checkpoint's meta.json; CheckpointFileError naming it when it is missing, unreadable or edited."""
    path = os.path.join(directory, META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointFileError(
            f"checkpoint file {path} is missing or corrupt ({e}): the save that wrote "
            f"{directory} did not finish, or the directory is not a zengine checkpoint"
        ) from e
    if (
        not isinstance(meta, dict)
        or meta.get("format") != FORMAT
        or meta.get("version", 0) > VERSION
    ):
        raise CheckpointFileError(
            f"checkpoint file {path}: not a zengine checkpoint of version <= {VERSION}"
        )
    if CHECKSUM in meta:
        if meta[CHECKSUM] != _checksum(meta):
            raise CheckpointFileError(
                f"checkpoint file {path} fails its checksum: it was edited or corrupted after "
                f"the save; restore it from a copy, or load another checkpoint"
            )
    elif meta.get("version", 0) >= 2:
        raise CheckpointFileError(
            f"checkpoint file {path} has no '{CHECKSUM}', which version {meta['version']} "
            f"always writes: it was edited after the save"
        )
    else:
        logger.warning(
            f"checkpoint file {path} is of version {meta.get('version')}, written before meta.json "
            f"carried a checksum: its content is not verified"
        )
    return meta


def check_files(directory: str, meta: dict[str, Any]) -> None:
    """Every file the checkpoint lists exists with its recorded size (cheap: no data is read)."""
    for name, entry in meta["files"].items():
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointFileError(f"checkpoint file {path} is missing") from None
        if size != entry["size"]:
            raise CheckpointFileError(
                f"checkpoint file {path} is {size} bytes but was written with "
                f"{entry['size']}: it is truncated or was modified"
            )
