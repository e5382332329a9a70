"""The ``zengine`` command's options: the parser, and the checks that reject wrong values before
anything is planned or started (what the machines must offer is ``plan.py``'s check)."""

from __future__ import annotations

import argparse
import os

from zengine.launcher.cores import CoreBindingError, parse_core_list
from zengine.launcher.hostfile import OPTION_LIKE
from zengine.launcher.rendezvous import (
    NodeCountError,
    add_arguments as add_rendezvous_arguments,
    requested_range,
)

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


class LaunchError(ValueError):
    """Options that cannot be launched; the message names the problem."""


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser; everything after the script is left to the script."""
    p = argparse.ArgumentParser(
        prog="zengine",
        description="Launch a training script on one or several machines "
        "(options as the deepspeed launcher; runs on torch.distributed.run).",
        allow_abbrev=False,
    )
    p.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help="File of 'hostname slots=N' lines. Default: "
        f"{DEFAULT_HOSTFILE} if it exists, else this machine only.",
    )
    p.add_argument(
        "-i",
        "--include",
        default="",
        help="Run only on these hosts/slots, e.g. 'worker-0:0,1@worker-1'.",
    )
    p.add_argument(
        "-e",
        "--exclude",
        default="",
        help="Run on every slot except these, e.g. 'worker-1:0@worker-2'.",
    )
    p.add_argument(
        "--num_nodes",
        type=int,
        default=None,
        help="Number of machines: the first N of the hostfile, or, without "
        "one, the total started by hand with --node_rank on each.",
    )
    p.add_argument(
        "--node_rank",
        type=int,
        default=None,
        help="This machine's rank when starting each of --num_nodes machines by hand.",
    )
    p.add_argument(
        "--num_gpus",
        "--num_procs",
        "--num_accelerators",
        dest="num_gpus",
        type=int,
        default=None,
        help="Processes per machine (one per GPU). "
        "Default: every local GPU, or 1 on a CPU machine.",
    )
    p.add_argument(
        "--master_addr",
        default=None,
        help=f"Address of the rank-0 machine. Default: {DEFAULT_MASTER_ADDR} on "
        "one machine, the first hostfile host on several.",
    )
    p.add_argument(
        "--master_port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"Port of the rendezvous store on the master (default {DEFAULT_MASTER_PORT}).",
    )
    p.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="Restart all workers up to this many times after a failure (default 0).",
    )
    add_rendezvous_arguments(p)
    p.add_argument(
        "--comm_timeout",
        type=float,
        default=None,
        help="Seconds a collective may wait for the other ranks before every rank fails with an "
        "error (overrides the config's comm_timeout; default: the config's, 300).",
    )
    p.add_argument(
        "--no_local_rank",
        action="store_true",
        help="Do not pass --local_rank=N to the script (LOCAL_RANK is still set).",
    )
    p.add_argument(
        "--deepspeed_compat",
        "--deepspeed-compat",
        action="store_true",
        help="Run an unmodified DeepSpeed script: "
        "`import deepspeed` resolves to zengine in each rank.",
    )
    p.add_argument(
        "--module",
        action="store_true",
        help="Treat the script as a Python module name, as 'python -m' does.",
    )
    p.add_argument(
        "--bind_cores_to_rank",
        action="store_true",
        help="Pin each rank of a node to its own consecutive share of the cores (every physical "
        "core, or --bind_core_list) and give it that many threads (launcher/cores.py).",
    )
    p.add_argument(
        "--bind_core_list",
        default=None,
        help="With --bind_cores_to_rank: the cores to share, e.g. '0-15,32-47' (default: every "
        "physical core).",
    )
    p.add_argument(
        "--autotuning",
        choices=("tune", "run"),
        default=None,
        help="Find the fastest config that fits (the config's 'autotuning' section; results in its "
        "results_dir): 'tune' writes it, 'run' then trains with it (zengine/autotuning/).",
    )
    p.add_argument("--ssh_port", type=int, default=None, help="Port for ssh to remote hosts.")
    p.add_argument(
        "--launcher",
        choices=("ssh", "pdsh"),
        default="ssh",
        help="How a hostfile job reaches the other hosts: one ssh per host, or one pdsh for all "
        "of them (DeepSpeed's default; every host must use the same slots).",
    )
    p.add_argument("user_script", help="The training script (or module, with --module).")
    p.add_argument(
        "user_args", nargs=argparse.REMAINDER, help="Arguments for the script, untouched."
    )
    return p


def check_args(args: argparse.Namespace) -> None:
    """Reject option values that are wrong whatever the machines are."""
    if args.num_gpus is not None and args.num_gpus < 1:
        raise LaunchError(f"--num_gpus must be at least 1, got {args.num_gpus}")
    if args.num_nodes is not None and args.num_nodes < 1:
        raise LaunchError(f"--num_nodes must be at least 1, got {args.num_nodes}")
    if args.node_rank is not None and args.node_rank < 0:
        raise LaunchError(f"--node_rank must be at least 0, got {args.node_rank}")
    if args.max_restarts < 0:
        raise LaunchError(f"--max_restarts must be at least 0, got {args.max_restarts}")
    if args.comm_timeout is not None and not args.comm_timeout > 0:
        raise LaunchError(
            f"--comm_timeout must be a positive number of seconds, got {args.comm_timeout}"
        )
    if args.master_addr is not None and args.master_addr.startswith("-"):
        raise LaunchError(f"--master_addr {args.master_addr!r} {OPTION_LIKE}")
    if not 0 < args.master_port < 65536:
        raise LaunchError(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.include and args.exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    if (args.include or args.exclude) and (args.num_gpus is not None or args.num_nodes is not None):
        raise LaunchError(
            "--include/--exclude choose the slots themselves; "
            "do not combine them with --num_gpus or --num_nodes"
        )
    for name in ("min_elastic_nodes", "max_elastic_nodes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise LaunchError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.bind_core_list is not None:
        if not args.bind_cores_to_rank:
            raise LaunchError(
                "--bind_core_list names the cores --bind_cores_to_rank shares; add it"
            )
        try:
            parse_core_list(args.bind_core_list)
        except CoreBindingError as err:
            raise LaunchError(str(err)) from None
    try:
        requested_range(args)
    except NodeCountError as err:
        raise LaunchError(str(err)) from None
    if not args.module and not os.path.isfile(args.user_script):
        raise LaunchError(f"training script {args.user_script!r} not found")
