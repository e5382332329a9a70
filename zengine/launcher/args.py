"""Command-line arguments that a training script adds for zengine."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add zengine's config options to a training script's ``parser``, and return it.

    Adds ``--deepspeed`` (a flag), ``--deepspeed_config PATH`` and
    ``--zengine_config PATH``, the names ``zengine.initialize(args=...)`` reads,
    so a DeepSpeed script keeps its command line unchanged.

    Like DeepSpeed's function of the same name, this does not add
    ``--local_rank``: the launcher passes ``--local_rank=N`` to every process
    (unless started with ``--no_local_rank``), so the script's parser must
    declare ``--local_rank`` itself, e.g.
    ``parser.add_argument("--local_rank", type=int, default=-1)``.
    """
    group = parser.add_argument_group("zengine", "zengine configuration")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable the ZeRO engine (the name DeepSpeed scripts use).",
    )
    group.add_argument(
        "--deepspeed_config",
        default=None,
        type=str,
        help="Path to a DeepSpeed-format JSON config file.",
    )
    group.add_argument(
        "--zengine_config",
        default=None,
        type=str,
        help="Path to a zengine JSON config file (same format as --deepspeed_config).",
    )
    return parser
