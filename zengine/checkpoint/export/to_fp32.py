"""``zengine-to-fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG]``: a sharded checkpoint to one fp32 state_dict file.

Streams one tensor at a time (see fp32.py): peak memory stays near the largest
tensor whatever the model's size. An OUTPUT_FILE ending in ``.safetensors``
gets the safetensors format, anything else a ``torch.save`` file.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..errors import CheckpointError
from .fp32 import convert_zero_checkpoint_to_fp32_state_dict


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zengine-to-fp32",
        description="Consolidate a zengine (ZeRO) checkpoint, saved by any stage and world size, into one fp32 "
        "state_dict file, without a process group.",
    )
    parser.add_argument(
        "checkpoint_dir",
        help="the save_dir given to engine.save_checkpoint (the folder with "
        "'latest'), or one checkpoint's folder",
    )
    parser.add_argument(
        "output_file", help="where to write; '.safetensors' for that format, else a torch file"
    )
    parser.add_argument(
        "--tag", default=None, help="the checkpoint tag (default: the one in 'latest')"
    )
    args = parser.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, args.tag)
    except (CheckpointError, OSError) as e:
        print(f"zengine-to-fp32: {e}", file=sys.stderr)
        return 1
    print(f"zengine-to-fp32: wrote {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
