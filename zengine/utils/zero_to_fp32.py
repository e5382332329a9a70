"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: one fp32 state_dict from a sharded checkpoint, in one
process, with no GPU and no process group (any stage, any world size). Also the command behind the
``zero_to_fp32.py`` script that ``save_checkpoint`` writes beside the checkpoints:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR_OR_FILE [-t TAG] [--safe_serialization]

``get_optim_files`` and ``get_model_state_file`` (what Lightning's own converter reads) answer for
DeepSpeed-written folders and zengine's alike.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import os
import shutil
import sys
import tempfile
from typing import Optional, Sequence

import torch

from ..checkpoint.export import fp32 as _fp32
from ..checkpoint.native import meta as _meta
from ..checkpoint.errors import CheckpointError
from ..checkpoint.native.reader import CheckpointReader

load_state_dict_from_zero_checkpoint = _fp32.load_state_dict_from_zero_checkpoint


def _refuse_frozen_filter(exclude_frozen_parameters: bool) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError(
            "exclude_frozen_parameters=True: zengine checkpoints keep frozen parameters "
            "with the others; drop them from the returned state_dict by name"
        )


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
):
    """The model's full fp32 state_dict (``lazy_mode`` is accepted: tensors are read one at a time either way)."""
    _refuse_frozen_filter(exclude_frozen_parameters)
    return _fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: str = "5GB",
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Write the fp32 state_dict: into ``output_dir`` as ``pytorch_model.bin`` (``model.safetensors``
    with ``safe_serialization``), or, when ``output_dir`` names a file (older DeepSpeed's
    ``output_file``), to that file. One file whatever ``max_shard_size`` says. Returns its path."""
    _refuse_frozen_filter(exclude_frozen_parameters)
    if os.path.isdir(output_dir) or not os.path.splitext(output_dir)[1]:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(
            output_dir, "model.safetensors" if safe_serialization else "pytorch_model.bin"
        )
    else:
        path = output_dir
    _fp32.convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, path, tag)
    return path


_STAND_INS: Optional[str] = None  # see _stand_in_folder


def _stand_in_folder() -> str:
    """This process's folder of the DeepSpeed-named stand-ins for zengine checkpoints (removed at
    exit)."""
    global _STAND_INS
    if _STAND_INS is None:
        _STAND_INS = tempfile.mkdtemp(prefix="zengine-ds-files-")
        atexit.register(shutil.rmtree, _STAND_INS, True)
    return _STAND_INS


def _stand_in(checkpoint_dir: str, name: str, content: dict) -> str:
    """``content`` saved as ``name`` in a folder of its own for ``checkpoint_dir``: its path."""
    prefix = os.path.basename(os.path.abspath(checkpoint_dir))
    folder = tempfile.mkdtemp(dir=_stand_in_folder(), prefix=prefix)
    path = os.path.join(folder, name)
    torch.save(content, path)
    return path


def _is_zengine(checkpoint_dir: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir, _meta.META))


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """DeepSpeed's: the optimizer files of one checkpoint folder (``save_dir/tag``), in rank order.

    A DeepSpeed-written folder: its ``*_optim_states.pt``. A zengine folder (``meta.json``) has no
    such files: one stand-in is written, outside the checkpoint, holding what readers take from them
    (Lightning's converter: ``["optimizer_state_dict"]["zero_stage"]``): ``zero_stage`` and
    ``partition_count`` (the saving world size). FileNotFoundError when the folder has neither."""
    if _is_zengine(checkpoint_dir):
        with CheckpointReader(
            checkpoint_dir
        ) as reader:  # (checks meta.json and the files it lists)
            meta = reader.meta
        summary = {"zero_stage": meta["zero_stage"], "partition_count": meta["world_size"]}
        return [
            _stand_in(
                checkpoint_dir,
                "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                {"optimizer_state_dict": summary},
            )
        ]
    files = sorted(
        glob.glob(os.path.join(checkpoint_dir, "*_optim_states.pt")),
        key=lambda f: [int(t) if t.isdigit() else t for t in os.path.basename(f).split("_")],
    )
    if not files:
        raise FileNotFoundError(
            f"no '*_optim_states.pt' files (DeepSpeed) nor meta.json (zengine) in {checkpoint_dir}"
        )
    return files


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """DeepSpeed's: the model-states file of rank 0 in one checkpoint folder, whose top level holds
    the ``client_state`` beside DeepSpeed's own keys (Lightning's converter keeps the former).

    A DeepSpeed-written folder: ``mp_rank_00_model_states.pt`` (``zero_pp_rank_0_...`` at stage 3).
    A zengine folder: a stand-in written outside the checkpoint with the ``client_state`` of its
    state.pt, read weights-only (tensors and plain values; CheckpointUntrustedError names anything
    else), and ``global_steps``, ``dp_world_size``, ``mp_world_size``. FileNotFoundError
    otherwise."""
    if _is_zengine(checkpoint_dir):
        with CheckpointReader(checkpoint_dir) as reader:
            client_state, meta = reader.read_state()["client_state"], reader.meta
        content = {
            **client_state,
            "global_steps": meta.get("global_steps"),
            "dp_world_size": meta["world_size"],
            "mp_world_size": 1,
        }
        return _stand_in(checkpoint_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt", content)
    name = "mp_rank_00_model_states.pt"
    if zero_stage == 3:
        name = "zero_pp_rank_0_" + name
    path = os.path.join(checkpoint_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line of DeepSpeed's zero_to_fp32.py."""
    parser = argparse.ArgumentParser(
        description="Write one fp32 state_dict from a zengine (ZeRO) checkpoint."
    )
    parser.add_argument(
        "checkpoint_dir",
        help="the save_dir of engine.save_checkpoint (with 'latest'), or one checkpoint's folder",
    )
    parser.add_argument(
        "output_dir", help="a folder (pytorch_model.bin / model.safetensors go there) or a file"
    )
    parser.add_argument(
        "-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')"
    )
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted; one file is written")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            args.max_shard_size,
            args.safe_serialization,
            args.tag,
            args.exclude_frozen_parameters,
        )
    except (CheckpointError, OSError, NotImplementedError) as e:
        print(f"zero_to_fp32: {e}", file=sys.stderr)
        return 1
    print(f"zero_to_fp32: wrote {path}")
    return 0


__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "load_state_dict_from_zero_checkpoint",
    "get_optim_files",
    "get_model_state_file",
    "main",
]

if __name__ == "__main__":
    sys.exit(main())
