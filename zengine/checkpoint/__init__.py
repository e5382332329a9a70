"""Checkpoints: sharded, layout-free, crash-safe; DeepSpeed's and DCP's layouts both ways; files for others.

- ``native/``: zengine's own checkpoint format. ``save.py`` / ``load.py`` are
  ``engine.save_checkpoint`` / ``engine.load_checkpoint``; a checkpoint records pieces of parameters
  (``pieces.py``), never a flat buffer, so it loads into any world size and stage; each rank writes
  and reads only what it holds (``holdings.py``, ``reader.py``). ``tensorfile.py``: rank files in
  the safetensors layout with per-block checksums; ``meta.py``: meta.json, with its own checksum;
  ``atomic.py``: staging directory, rename, ``latest``, finding a tag; ``background.py``: saves
  that finish on a thread; ``rng.py``: generator states; ``safe_load.py``: state.pt unpickled
  weights-only (no code runs) unless ``load_checkpoint(..., trust_client_state=True)``;
  ``torchfile.py``: torch files written tensor by tensor; ``collectives.py``: the few collectives
  a save or load needs.
- ``deepspeed/``: DeepSpeed 0.19's ZeRO checkpoints both ways. ``reader.py`` lets
  ``load_checkpoint`` read one directly; ``export.py`` writes a zengine checkpoint in DeepSpeed's
  layout; ``layout.py``: one object per DeepSpeed writer (stages 1, 2, its bf16 optimizer, stage 3:
  file names, keys, partitions), chosen once; ``partition.py``: where DeepSpeed puts each element
  (pure arithmetic); ``files.py``: its files read and written without DeepSpeed.
  ``universal.py``: DeepSpeed's universal checkpoints (ds_to_universal's ``zero/<param>/*.pt``), read with
  ``checkpoint.load_universal``; ``universal_export.py`` (``zengine-convert to-universal``) writes them.
- ``dcp/``: torch.distributed.checkpoint, FSDP2's and torchtitan's format, both ways. ``reader.py``: a DCP
  folder read by ``load_checkpoint`` (each rank the rows covering its pieces, through DCP's reader and
  planner: ``storage.py``); ``sections.py`` finds the model, optimizer and train state among the keys;
  ``boxes.py``: flat ranges and N-d chunks (pure arithmetic); ``save.py``:
  ``save_checkpoint(..., checkpoint_format="dcp")``, synchronous or in the background; ``writer.py``: DCP's
  files from boxes through DCP's writer and planner helpers; ``export.py``: ``zengine-convert to-dcp``.
- ``formats.py``: which reader reads a folder (zengine's, DeepSpeed's ZeRO or universal, DCP).
- ``export/``: files for other tools. ``fp32.py`` and ``to_fp32.py`` (``zengine-to-fp32``): the
  full fp32 state_dict in one process, streamed tensor by tensor, reading meta.json and the rank
  files only (nothing unpickled); ``hf.py``: one fp32 safetensors file, tied weights once;
  ``convert.py`` (``zengine-convert``); ``model16.py``: ``engine.save_16bit_model``; ``shards.py``:
  the state_dict in Hugging Face style shards (DeepSpeed's ``max_shard_size``). ``fp32.open_checkpoint``
  opens either kind, zengine's or DeepSpeed's, for all of them.
- ``errors.py``: the exceptions of all three; ``utils.py``: DeepSpeed's
  ``deepspeed.checkpoint.utils``.
"""

from .errors import (
    CheckpointError,
    CheckpointFileError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointUntrustedError,
)
from .deepspeed.export import DeepSpeedExportError, export_deepspeed_checkpoint
from .deepspeed.reader import DeepSpeedCheckpointError
from .export.fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    iter_fp32_state_dict,
    load_state_dict_from_zero_checkpoint,
)
from .native.load import load_checkpoint
from .export.hf import export_safetensors, load_safetensors_state_dict
from .export.model16 import save_16bit_model
from .native.save import save_checkpoint

__all__ = [
    "DeepSpeedCheckpointError",
    "DeepSpeedExportError",
    "export_deepspeed_checkpoint",
    "export_safetensors",
    "load_safetensors_state_dict",
    "CheckpointError",
    "CheckpointFileError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointUntrustedError",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "iter_fp32_state_dict",
    "load_state_dict_from_zero_checkpoint",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
]
