"""Checkpoints: sharded, layout-free, crash-safe; the fp32 export and the 16-bit model file.

- ``save.py`` / ``load.py``: ``engine.save_checkpoint`` / ``engine.load_checkpoint``. A checkpoint
  records pieces of parameters (``pieces.py``), never a flat buffer, so it loads into any world size
  and stage; each rank writes and reads only what it holds (``holdings.py``, ``reader.py``).
- ``tensorfile.py``: rank files in the safetensors layout with per-block checksums; ``meta.py``:
  meta.json, with its own checksum; ``atomic.py``: staging directory, rename, ``latest``, finding a
  tag; ``rng.py``: generator states; ``safe_load.py``: state.pt unpickled weights-only (no code runs)
  unless ``load_checkpoint(..., trust_client_state=True)``.
- ``fp32.py`` and ``to_fp32.py`` (``zengine-to-fp32``): the full fp32 state_dict in one process,
  streamed tensor by tensor (``torchfile.py`` writes torch files that way); they read meta.json and the
  rank files only, never unpickle anything.
- ``model16.py``: ``engine.save_16bit_model``.
"""
from .errors import (CheckpointError, CheckpointFileError, CheckpointMismatchError, CheckpointNotFoundError,
                     CheckpointSaveError, CheckpointUntrustedError)
from .fp32 import (convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
                   iter_fp32_state_dict, load_state_dict_from_zero_checkpoint)
from .load import load_checkpoint
from .model16 import save_16bit_model
from .save import save_checkpoint

__all__ = ["CheckpointError", "CheckpointFileError", "CheckpointMismatchError", "CheckpointNotFoundError",
           "CheckpointSaveError", "CheckpointUntrustedError", "convert_zero_checkpoint_to_fp32_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "iter_fp32_state_dict", "load_state_dict_from_zero_checkpoint",
           "load_checkpoint", "save_16bit_model", "save_checkpoint"]
