"""A checkpoint as one Hugging Face style ``model.safetensors``: fp32, tied weights stored once.

The checkpoint is zengine's, or DeepSpeed 0.19's (read by deepspeed/reader.py: DeepSpeed need not be installed).

safetensors has no shared tensors. Hugging Face's ``save_pretrained`` therefore writes a tied weight under
its first name only (GPT-2's ``transformer.wte.weight``, not ``lm_head.weight``) and ``from_pretrained``
ties the other name back from the model's config. This export does the same: each tensor once, in
``state_dict`` order, streamed one at a time (fp32.py), and the names left out recorded in the file's
metadata (``"tied"``: a JSON object alias -> stored name) so that ``load_safetensors_state_dict`` gives
back every key, the aliases sharing their source's tensor. A plain ``model.load_state_dict(sd,
strict=False)`` of the file also works for a model whose weights are tied in its constructor.

The file is written by zengine's own writer (native/tensorfile.py: the safetensors layout), so exporting needs no
extra package; reading it back with ``load_safetensors_state_dict`` uses the ``safetensors`` package
(installed with transformers), imported only then.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Optional

import torch

from .fp32 import TIED_KEY, open_checkpoint, write_safetensors


def export_safetensors(
    checkpoint_dir: str, output_file: str, tag: Optional[str] = None, trusted: bool = False
) -> dict[str, str]:
    """Write the fp32 model of a zengine checkpoint (any stage, any world size), or of a DeepSpeed 0.19 ZeRO
    checkpoint (without DeepSpeed), to ``output_file`` in the safetensors format, each tied weight once.
    Returns the aliases left out ({alias: stored name}). ``trusted``: a DeepSpeed client_state may hold
    objects of your own classes (only then is it unpickled beyond tensors and plain values)."""
    tmp = f"{output_file}.tmp-{secrets.token_hex(4)}"
    try:
        with open_checkpoint(checkpoint_dir, tag, trusted) as reader:
            tied = write_safetensors(reader, tmp)
        os.replace(tmp, output_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return tied


def load_safetensors_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every key of a file written by ``export_safetensors``, tied names sharing one tensor (needs the
    ``safetensors`` package: ``pip install safetensors``)."""
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError(
            "load_safetensors_state_dict needs the 'safetensors' package (pip install "
            "safetensors; transformers installs it)"
        ) from e
    with safe_open(path, framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        tied = json.loads((f.metadata() or {}).get(TIED_KEY, "{}"))
    for alias, source in tied.items():
        state[alias] = state[source]
    return state
