"""The environment the workers get: the variables the launcher sets for the ranks of a node
(:func:`worker_env`), and, for remote hosts, what goes along from the launching shell
(:func:`exported_env`: matching variables, then the lines of ``.deepspeed_env`` /
``.zengine_env`` files)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from zengine.launcher.cores import (
    BIND_CORES_ENV,
    CoreBindingError,
    cores_for_rank,
    default_core_list,
    parse_core_list,
)
from zengine.launcher.entry import COMPAT_ENV, NO_LOCAL_RANK_ENV, RUN_MODULE_ENV
from zengine.launcher.options import LaunchError
from zengine.launcher.plan import NodePlan

# Variables copied from the launching shell to every remote host, as DeepSpeed does.
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "MV2_")
EXPORT_NAMES = ("PATH",)
# Files of extra KEY=VALUE lines for remote hosts, looked for in ~ then in the
# working directory (later files win).
ENV_FILE_NAMES = (".deepspeed_env", ".zengine_env")
# DeepSpeed's name of it (accelerate's launcher imports it from deepspeed.launcher.runner)
DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]


def worker_env(
    node: NodePlan, args: argparse.Namespace, visible_devices: Sequence[str] | None
) -> dict[str, str]:
    """Variables the ranks on ``node`` need on top of the inherited environment.

    ``visible_devices`` is the device list ranks may pick from (the current
    ``CUDA_VISIBLE_DEVICES`` split, or all device indices), or ``None`` on a
    machine without GPUs, where slots only count processes.
    """
    env: dict[str, str] = {}
    if args.no_local_rank:
        env[NO_LOCAL_RANK_ENV] = "1"
    if args.module:
        env[RUN_MODULE_ENV] = "1"
    if args.deepspeed_compat:
        env[COMPAT_ENV] = "1"
    if getattr(args, "bind_cores_to_rank", False):  # each rank pins its share (cores.py)
        env[BIND_CORES_ENV] = args.bind_core_list or default_core_list()
        try:  # enough cores for every rank of the node: said before anything starts
            cores_for_rank(parse_core_list(env[BIND_CORES_ENV]), node.nproc, 0)
        except CoreBindingError as err:
            raise LaunchError(str(err)) from None
    if args.comm_timeout is not None:
        env["ZENGINE_COMM_TIMEOUT"] = repr(float(args.comm_timeout))
    # Rank i uses device i; narrow the visible devices only when the chosen
    # slots are not already 0..n-1.
    if visible_devices is not None and list(node.slots) != list(range(node.nproc)):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices[s] for s in node.slots)
    return env


def read_env_file(path: str) -> dict[str, str]:
    """Parse a ``.deepspeed_env``-style file of ``KEY=VALUE`` lines (``#`` comments, blanks)."""
    env: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier():
                raise LaunchError(f"{path}, line {lineno}: expected KEY=VALUE, got {line!r}")
            env[key] = value.strip()
    return env


def exported_env(environ: Mapping[str, str], env_files: Sequence[str]) -> dict[str, str]:
    """What a remote host gets from here: matching variables, then the env files' lines."""
    env = {
        key: value
        for key, value in environ.items()
        if key.startswith(EXPORT_PREFIXES) or key in EXPORT_NAMES
    }
    for path in env_files:
        env.update(read_env_file(path))
    return env


def default_env_files(cwd: str) -> list[str]:
    """The env files that exist, ``~`` before the working directory."""
    folders = [os.path.expanduser("~"), cwd]
    candidates = [os.path.join(folder, name) for folder in folders for name in ENV_FILE_NAMES]
    seen: list[str] = []
    for path in candidates:
        if os.path.isfile(path) and os.path.realpath(path) not in map(os.path.realpath, seen):
            seen.append(path)
    return seen
