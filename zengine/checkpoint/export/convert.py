"""``zengine-convert``: a zengine checkpoint out to DeepSpeed or to one safetensors file, offline.

    zengine-convert to-deepspeed CHECKPOINT_DIR OUTPUT_DIR --world-size N --config ds_config.json [--tag T]
    zengine-convert to-safetensors CHECKPOINT_DIR OUTPUT_FILE [--tag T] [--trust]
    zengine-convert to-dcp CHECKPOINT_DIR OUTPUT_DIR [--tag T] [--trust]
    zengine-convert to-universal CHECKPOINT_DIR OUTPUT_DIR --config ds_config.json [--tag T]

``to-deepspeed`` writes DeepSpeed 0.19's ZeRO layout for N ranks running that DeepSpeed config
(deepspeed/export.py); DeepSpeed continues with ``engine.load_checkpoint(OUTPUT_DIR)``. ``to-safetensors`` writes
the fp32 model with tied weights once (hf.py), from a zengine checkpoint or from a DeepSpeed one
(without DeepSpeed installed). ``to-dcp`` writes torch.distributed.checkpoint's folder in
``get_state_dict``'s layout, which FSDP2 loads with ``dcp.load`` + ``set_state_dict`` (dcp/export.py).
``to-universal`` writes DeepSpeed's universal checkpoint (ds_to_universal's layout), which DeepSpeed loads at any
world size with ``checkpoint.load_universal`` (deepspeed/universal_export.py). The other way needs no command: zengine's
``engine.load_checkpoint(deepspeed_save_dir, tag)`` reads DeepSpeed's checkpoints directly.
Also runs as ``python -m zengine.checkpoint.export.convert``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import hjson

from ..deepspeed.export import DeepSpeedExportError, export_deepspeed_checkpoint
from ..deepspeed.universal_export import export_universal_checkpoint
from ..errors import CheckpointError
from .hf import export_safetensors


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zengine-convert",
        description="Convert a checkpoint (any stage, any world "
        "size) for DeepSpeed or for Hugging Face, without a process group.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ds = sub.add_parser(
        "to-deepspeed", help="DeepSpeed 0.19's ZeRO layout (save_dir/<tag>/ and latest)"
    )
    ds.add_argument(
        "checkpoint_dir", help="the save_dir of engine.save_checkpoint, or one checkpoint's folder"
    )
    ds.add_argument("output_dir", help="the DeepSpeed save_dir to write (its <tag>/ and 'latest')")
    ds.add_argument(
        "--world-size", type=int, required=True, help="the data-parallel ranks DeepSpeed will run"
    )
    ds.add_argument(
        "--config",
        required=True,
        help="the DeepSpeed config JSON DeepSpeed will run (its ZeRO "
        "stage and precision decide the layout)",
    )
    ds.add_argument(
        "--tag", default=None, help="the zengine checkpoint tag (default: the one in 'latest')"
    )
    ds.add_argument("--out-tag", default=None, help="the DeepSpeed tag (default: global_step<N>)")
    ds.add_argument(
        "--trust",
        action="store_true",
        help="state.pt may hold objects of your own classes "
        "(unpickled as torch.load(weights_only=False) would)",
    )
    st = sub.add_parser(
        "to-safetensors", help="one fp32 model.safetensors, tied weights stored once"
    )
    st.add_argument(
        "checkpoint_dir", help="a zengine or DeepSpeed save_dir, or one checkpoint's folder"
    )
    st.add_argument("output_file")
    st.add_argument("--tag", default=None, help="the checkpoint tag (default: the one in 'latest')")
    st.add_argument(
        "--trust",
        action="store_true",
        help="a DeepSpeed client_state may hold objects of your own classes",
    )
    dc = sub.add_parser(
        "to-dcp", help="torch.distributed.checkpoint (FSDP2's: dcp.load + set_state_dict)"
    )
    dc.add_argument(
        "checkpoint_dir", help="the save_dir of engine.save_checkpoint, or one checkpoint's folder"
    )
    dc.add_argument("output_dir", help="the DCP folder to write (new or empty)")
    dc.add_argument("--tag", default=None, help="the checkpoint tag (default: the one in 'latest')")
    dc.add_argument(
        "--trust", action="store_true", help="state.pt may hold objects of your own classes"
    )
    un = sub.add_parser(
        "to-universal",
        help="DeepSpeed's universal checkpoint (<tag>_universal/ and latest_universal)",
    )
    un.add_argument(
        "checkpoint_dir", help="the save_dir of engine.save_checkpoint, or one checkpoint's folder"
    )
    un.add_argument("output_dir", help="the DeepSpeed save_dir to write")
    un.add_argument(
        "--config",
        required=True,
        help="the DeepSpeed config JSON DeepSpeed will run (its ZeRO stage and precision decide "
        "the model-states file)",
    )
    un.add_argument(
        "--tag", default=None, help="the zengine checkpoint tag (default: the one in 'latest')"
    )
    un.add_argument(
        "--out-tag", default=None, help="the folder's name (default: global_step<N>_universal)"
    )
    un.add_argument(
        "--trust", action="store_true", help="state.pt may hold objects of your own classes"
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "to-deepspeed":
            with open(args.config) as f:
                config = hjson.load(f)
            if args.world_size < 1:
                raise DeepSpeedExportError(
                    f"--world-size must be at least 1, got {args.world_size}"
                )
            written = export_deepspeed_checkpoint(
                args.checkpoint_dir,
                args.output_dir,
                args.world_size,
                config,
                args.tag,
                args.out_tag,
                args.trust,
            )
        elif args.command == "to-universal":
            with open(args.config) as f:
                config = hjson.load(f)
            written = export_universal_checkpoint(
                args.checkpoint_dir, args.output_dir, config, args.tag, args.out_tag, args.trust
            )
        elif args.command == "to-dcp":
            from ..dcp.export import export_dcp_checkpoint  # imports torch.distributed.checkpoint

            written = export_dcp_checkpoint(
                args.checkpoint_dir, args.output_dir, args.tag, args.trust
            )
        else:
            tied = export_safetensors(args.checkpoint_dir, args.output_file, args.tag, args.trust)
            written = args.output_file + (f" (tied, stored once: {tied})" if tied else "")
    except (CheckpointError, DeepSpeedExportError, OSError, ValueError) as e:
        print(f"zengine-convert: {e}", file=sys.stderr)
        return 1
    print(f"zengine-convert: wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
