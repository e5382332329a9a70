"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: one fp32 state_dict from a sharded checkpoint, in one
process, with no GPU and no process group (any stage, any world size). Also the commands behind the
``zero_to_fp32.py`` and ``zero_to_torch.py`` scripts that ``save_checkpoint`` writes beside the
checkpoints, as DeepSpeed does (they need zengine only, no compat mode):

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR_OR_FILE [-t TAG] [--safe_serialization]
    python zero_to_torch.py CHECKPOINT_DIR OUTPUT_DIR_OR_FILE --dtype bf16 [-t TAG]

Every function here reads zengine checkpoints and DeepSpeed 0.19's alike (checkpoint/export/fp32.py).

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
from typing import Optional, Sequence, Union

import torch

from ..checkpoint.deepspeed.files import load_ds_file
from ..checkpoint.export import fp32 as _fp32, shards as _shards
from ..checkpoint.native import meta as _meta
from ..checkpoint.errors import CheckpointError
from ..checkpoint.native.reader import CheckpointReader

load_state_dict_from_zero_checkpoint = _fp32.load_state_dict_from_zero_checkpoint


# DeepSpeed's names for the output dtypes of convert_zero_checkpoint_to_state_dict / zero_to_torch.py
OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _output_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """A torch dtype from DeepSpeed's names ("bf16", "torch.float16", ...) or a torch dtype."""
    found = dtype
    if isinstance(dtype, str):
        found = OUTPUT_DTYPE_NAMES.get(dtype.removeprefix("torch.").lower())
    if found not in OUTPUT_DTYPE_NAMES.values():
        raise ValueError(
            f"output dtype {dtype!r} is not one of {', '.join(sorted(OUTPUT_DTYPE_NAMES))}"
        )
    return found


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> "dict[str, torch.Tensor]":
    """The model's full fp32 state_dict from a zengine checkpoint or a DeepSpeed-written one
    (``checkpoint_dir``: the save_dir; ``tag`` default: the one in ``latest``). ``lazy_mode`` is
    accepted: its callers call ``.contiguous()`` on each value, which a tensor answers."""
    return _fp32.get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters
    )


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    dtype: Union[str, torch.dtype] = torch.float32,
    max_shard_size: Optional[str] = "5GB",
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
) -> str:
    """Write the state_dict, floating-point tensors in ``dtype``, into ``output_dir``: as
    ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), or, for a model over
    ``max_shard_size``, as shards with their index (``pytorch_model-00001-of-00002.bin`` ...,
    ``pytorch_model.bin.index.json``), as DeepSpeed does; when ``output_dir`` names a file (older
    DeepSpeed's ``output_file``), one file there. Returns the file's path (the index's when sharded)."""
    out_dtype = _output_dtype(dtype)
    if os.path.isdir(output_dir) or not os.path.splitext(output_dir)[1]:
        os.makedirs(output_dir, exist_ok=True)
        name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
        paths = _shards.write_shards(
            checkpoint_dir,
            output_dir,
            name,
            max_shard_size,
            tag,
            exclude_frozen_parameters,
            out_dtype,
        )
        return paths[-1]
    _fp32.convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir, output_dir, tag, exclude_frozen_parameters, out_dtype
    )
    return output_dir


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: Optional[str] = "5GB",
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
) -> str:
    """``convert_zero_checkpoint_to_state_dict`` in fp32. Returns the file's path."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        torch.float32,
        max_shard_size,
        safe_serialization,
        tag,
        exclude_frozen_parameters,
    )


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

    zengine answers with stand-ins written outside the checkpoint, one per saving rank, holding what
    readers take from these files (Lightning's converter: ``["optimizer_state_dict"]["zero_stage"]``):
    ``zero_stage`` and ``partition_count``. A zengine folder (``meta.json``) has no such files; a
    DeepSpeed-written folder has them, but they pickle DeepSpeed's own classes, which ``torch.load``
    cannot rebuild without DeepSpeed installed (zengine reads them as plain data: files.py; the stage
    of DeepSpeed's bf16 optimizer, which records none, is 1). FileNotFoundError when the folder has
    neither."""
    if _is_zengine(checkpoint_dir):
        # (the reader checks meta.json and the files it lists)
        with CheckpointReader(checkpoint_dir) as reader:
            stage, world = reader.meta["zero_stage"], reader.meta["world_size"]
        return [_optim_stand_in(checkpoint_dir, r, stage, world) for r in range(world)]
    files = sorted(
        glob.glob(os.path.join(checkpoint_dir, "*_optim_states.pt")),
        key=lambda f: [int(t) if t.isdigit() else t for t in os.path.basename(f).split("_")],
    )
    if not files:
        raise FileNotFoundError(
            f"no '*_optim_states.pt' files (DeepSpeed) nor meta.json (zengine) in {checkpoint_dir}"
        )
    saved = load_ds_file(files[0])["optimizer_state_dict"]
    stage = int(saved["zero_stage"]) if "zero_stage" in saved else 1
    return [_optim_stand_in(checkpoint_dir, r, stage, len(files)) for r in range(len(files))]


def _optim_stand_in(checkpoint_dir: str, rank: int, stage: int, world: int) -> str:
    name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    summary = {"zero_stage": stage, "partition_count": world}
    return _stand_in(checkpoint_dir, name, {"optimizer_state_dict": summary})


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """DeepSpeed's: the model-states file of rank 0 in one checkpoint folder, whose top level holds
    the ``client_state`` beside DeepSpeed's own keys (Lightning's converter keeps the former).

    A DeepSpeed-written folder: ``mp_rank_00_model_states.pt`` (``zero_pp_rank_0_...`` at stage 3;
    it holds no DeepSpeed classes: torch loads it without DeepSpeed).
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


def _parser(description: str, with_dtype: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "checkpoint_dir",
        help="the save_dir of engine.save_checkpoint (with 'latest'), or one checkpoint's folder",
    )
    parser.add_argument(
        "output_dir", help="a folder (pytorch_model.bin / model.safetensors go there) or a file"
    )
    if with_dtype:
        parser.add_argument(
            "--dtype", required=True, choices=sorted(OUTPUT_DTYPE_NAMES), help="output dtype"
        )
    parser.add_argument(
        "-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')"
    )
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument(
        "--max_shard_size", default="5GB", help="largest file into a folder, e.g. 5GB or 500MB"
    )
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted")
    return parser


def _run(args: argparse.Namespace, dtype: Union[str, torch.dtype], prog: str) -> int:
    try:
        path = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            dtype,
            args.max_shard_size,
            args.safe_serialization,
            args.tag,
            args.exclude_frozen_parameters,
        )
    except (CheckpointError, OSError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    print(f"{prog}: wrote {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line of DeepSpeed's zero_to_fp32.py, on zengine and DeepSpeed checkpoints."""
    parser = _parser(
        "Write one fp32 state_dict from a zengine or DeepSpeed ZeRO checkpoint.", False
    )
    return _run(parser.parse_args(argv), torch.float32, "zero_to_fp32")


def torch_main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line of DeepSpeed's zero_to_torch.py: as ``main``, with a required ``--dtype``."""
    parser = _parser("Write one state_dict in fp32, fp16 or bf16 from a ZeRO checkpoint.", True)
    args = parser.parse_args(argv)
    return _run(args, args.dtype, "zero_to_torch")


__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "OUTPUT_DTYPE_NAMES",
    "load_state_dict_from_zero_checkpoint",
    "get_optim_files",
    "get_model_state_file",
    "main",
    "torch_main",
]

if __name__ == "__main__":
    sys.exit(main())
