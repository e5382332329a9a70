"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: one fp32 state_dict from a sharded checkpoint, in one
process, with no GPU and no process group (any stage, any world size). Also the command behind the
``zero_to_fp32.py`` script that ``save_checkpoint`` writes beside the checkpoints:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR_OR_FILE [-t TAG] [--safe_serialization]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


from ..checkpoint.export import fp32 as _fp32
from ..checkpoint.errors import CheckpointError

load_state_dict_from_zero_checkpoint = _fp32.load_state_dict_from_zero_checkpoint


def _refuse_frozen_filter(exclude_frozen_parameters: bool) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError("exclude_frozen_parameters=True: zengine checkpoints keep frozen parameters "
                                  "with the others; drop them from the returned state_dict by name")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False, lazy_mode: bool = False):
    """The model's full fp32 state_dict (``lazy_mode`` is accepted: tensors are read one at a time either way)."""
    _refuse_frozen_filter(exclude_frozen_parameters)
    return _fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Write the fp32 state_dict: into ``output_dir`` as ``pytorch_model.bin`` (``model.safetensors``
    with ``safe_serialization``), or, when ``output_dir`` names a file (older DeepSpeed's
    ``output_file``), to that file. One file whatever ``max_shard_size`` says. Returns its path."""
    _refuse_frozen_filter(exclude_frozen_parameters)
    if os.path.isdir(output_dir) or not os.path.splitext(output_dir)[1]:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "model.safetensors" if safe_serialization else "pytorch_model.bin")
    else:
        path = output_dir
    _fp32.convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, path, tag)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line of DeepSpeed's zero_to_fp32.py."""
    parser = argparse.ArgumentParser(description="Write one fp32 state_dict from a zengine (ZeRO) checkpoint.")
    parser.add_argument("checkpoint_dir", help="the save_dir of engine.save_checkpoint (with 'latest'), or one "
                                               "checkpoint's folder")
    parser.add_argument("output_dir", help="a folder (pytorch_model.bin / model.safetensors go there) or a file")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted; one file is written")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                          args.safe_serialization, args.tag,
                                                          args.exclude_frozen_parameters)
    except (CheckpointError, OSError, NotImplementedError) as e:
        print(f"zero_to_fp32: {e}", file=sys.stderr)
        return 1
    print(f"zero_to_fp32: wrote {path}")
    return 0


__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "main"]

if __name__ == "__main__":
    sys.exit(main())
