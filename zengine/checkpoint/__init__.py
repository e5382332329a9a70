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
- DeepSpeed both ways: ``ds_reader.py`` lets ``load_checkpoint`` read a DeepSpeed 0.19 ZeRO checkpoint
  directly (``ds_layout.py``: where DeepSpeed puts each element; ``ds_pickle.py``: its files read and
  written without DeepSpeed); ``ds_export.py`` writes a zengine checkpoint in DeepSpeed's layout;
  ``hf_export.py`` one fp32 safetensors file, tied weights once; ``convert.py`` (``zengine-convert``).
"""
from .errors import (CheckpointError, CheckpointFileError, CheckpointMismatchError, CheckpointNotFoundError,
                     CheckpointSaveError, CheckpointUntrustedError)
from .ds_export import DeepSpeedExportError, export_deepspeed_checkpoint
from .ds_reader import DeepSpeedCheckpointError
from .fp32 import (convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
                   iter_fp32_state_dict, load_state_dict_from_zero_checkpoint)
from .load import load_checkpoint
from .hf_export import export_safetensors, load_safetensors_state_dict
from .model16 import save_16bit_model
from .save import save_checkpoint

__all__ = ["DeepSpeedCheckpointError", "DeepSpeedExportError", "export_deepspeed_checkpoint", "export_safetensors",
           "load_safetensors_state_dict", "CheckpointError", "CheckpointFileError", "CheckpointMismatchError", "CheckpointNotFoundError",
           "CheckpointSaveError", "CheckpointUntrustedError", "convert_zero_checkpoint_to_fp32_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "iter_fp32_state_dict", "load_state_dict_from_zero_checkpoint",
           "load_checkpoint", "save_16bit_model", "save_checkpoint"]
