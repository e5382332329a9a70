"""The state_dict of a checkpoint as Hugging Face style shards: DeepSpeed's ``max_shard_size``.

DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict(..., max_shard_size="5GB")`` cuts the state_dict
with huggingface_hub's splitter, in state_dict order, and writes ``pytorch_model.bin`` (or
``model.safetensors``) when it fits one file, else ``pytorch_model-00001-of-0000N.bin`` ... and an index
``pytorch_model.bin.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {key: file}}``) that
``transformers``' ``from_pretrained`` reads. The cut is planned here from meta alone (shapes and dtypes:
no tensor is read), with huggingface_hub's own splitter; each file is then streamed by fp32.py, one
tensor at a time. Tied keys share a file (the splitter keeps a storage's names together).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

from ..native import meta as meta_mod
from . import fp32


def _sizes(meta: dict, exclude_frozen: bool, dtype: Optional[torch.dtype]) -> dict[str, tuple]:
    """key -> (storage, bytes) in state_dict order; a tied key names its source's storage."""
    out = {}
    for key, kind, source in fp32.kept_rows(meta, exclude_frozen):
        entry = meta["params" if kind == "param" else "buffers"][source]
        saved = torch.float32 if kind == "param" else meta_mod.dtype_of(entry["dtype"])
        written = dtype if dtype is not None and saved.is_floating_point else saved
        out[key] = ((kind, source), math.prod(entry["shape"]) * written.itemsize)
    return out


def write_shards(
    checkpoint_dir: str,
    output_dir: str,
    weights_name: str,
    max_shard_size: Optional[str],
    tag: Optional[str] = None,
    exclude_frozen: bool = False,
    dtype: Optional[torch.dtype] = None,
) -> list[str]:
    """Write the state_dict into ``output_dir`` as ``weights_name``, or as shards of at most
    ``max_shard_size`` (``"5GB"``, ``"500MB"``, an int of bytes; None: one file) with their index.
    Returns the paths written. Sharding needs huggingface_hub (installed with transformers), as
    DeepSpeed's does."""
    if max_shard_size is None:
        path = os.path.join(output_dir, weights_name)
        fp32.convert_zero_checkpoint_to_fp32_state_dict(
            checkpoint_dir, path, tag, exclude_frozen, dtype
        )
        return [path]
    try:
        from huggingface_hub import split_state_dict_into_shards_factory
    except ImportError as e:
        raise ImportError(
            "max_shard_size needs huggingface_hub (pip install huggingface_hub), as DeepSpeed's "
            "converter does; or pass max_shard_size=None for one file"
        ) from e
    with fp32.open_checkpoint(checkpoint_dir, tag) as reader:
        sizes = _sizes(reader.meta, exclude_frozen, dtype)
    stem, ext = os.path.splitext(weights_name)
    split = split_state_dict_into_shards_factory(
        sizes,
        get_storage_size=lambda entry: entry[1],
        get_storage_id=lambda entry: entry[0],
        filename_pattern=stem + "{suffix}" + ext,
        max_shard_size=max_shard_size,
    )
    paths = []
    for name, keys in split.filename_to_tensors.items():
        path = os.path.join(output_dir, name)
        fp32.convert_zero_checkpoint_to_fp32_state_dict(
            checkpoint_dir, path, tag, exclude_frozen, dtype, keys=set(keys)
        )
        paths.append(path)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        path = os.path.join(output_dir, weights_name + ".index.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        paths.append(path)
    return paths
