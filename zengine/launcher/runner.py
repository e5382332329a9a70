"""The ``zengine`` command: start a training script on every slot, like ``deepspeed``.

``zengine [options] script.py [script args]``. Process supervision, restarts
and rendezvous are ``torch.distributed.run``'s (torchrun); the launcher only
decides what to run where, one job per module:

1. ``options.py`` parses and checks the options (every input error is reported
   before anything starts);
2. ``plan.py``'s :func:`plan_launch` turns them, the hostfile and the local device
   count into a :class:`LaunchPlan`: which hosts, which slots on each, who is master;
   on several machines every host of the plan must resolve to an address
   (``remote.py``'s :func:`resolve_for_ssh`), else the launch stops there, naming it;
3. one machine: torchrun runs in this process (:func:`run_local`), with each
   rank started as ``-m zengine.launcher.entry script args`` (see ``entry.py``)
   and the variables of ``environment.py``'s :func:`worker_env`;
   several machines: one ``ssh -- HOST "cd CWD && env ... python -m
   torch.distributed.run ..."`` per host, or one ``pdsh`` for all (``remote.py``),
   started and waited for by :func:`run_remote`.
   A host (or ``--master_addr``) that starts with ``-`` is refused before
   anything runs: ssh or pdsh would read it as an option.

How the ranks meet (static or c10d rendezvous, elastic node ranges) is ``rendezvous.py``'s.
This module runs the plan (:func:`main`, the console script).

The launcher exits with the workers' exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# DEEPSPEED_ENVIRONMENT_NAME: deepspeed.launcher.runner's name, which accelerate imports
from zengine.launcher.environment import (
    DEEPSPEED_ENVIRONMENT_NAME,
    default_env_files,
    exported_env,
    worker_env,
)
from zengine.launcher.hostfile import HostfileError, check_hosts_resolve, parse_hostfile
from zengine.launcher.options import DEFAULT_HOSTFILE, LaunchError, build_parser, check_args
from zengine.launcher.plan import LOCAL_HOST, LaunchPlan, plan_launch, torchrun_argv
from zengine.launcher.remote import pdsh_command, resolve_for_ssh, ssh_command
from zengine.launcher.rendezvous import NodeCountError, rendezvous_env, uses_c10d

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main", "run_local", "run_remote"]


def _is_local_host(host: str) -> bool:
    if host in (LOCAL_HOST, "127.0.0.1", "::1"):
        return True
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    return host in names


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise LaunchError(
                f"--master_port {port} is already in use on this machine; choose another"
            ) from None


@contextlib.contextmanager
def _environ_set(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` (which torchrun hands to workers), restoring it after."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _exit_code(code: int) -> int:
    """A worker's exit status as a shell reports it (signals as 128 + signal number)."""
    if code < 0:
        return 128 - code
    return code or 1


def run_local(
    plan: LaunchPlan, args: argparse.Namespace, visible_devices: Sequence[str] | None
) -> int:
    """Run torchrun in this process for the plan's one node; return the workers' exit code."""
    node = plan.nodes[0]
    env = {**worker_env(node, args, visible_devices), **rendezvous_env(args, plan.node_range)}
    with _environ_set(env):
        try:
            # run(parse_args()) is main() without its @record wrapper, which
            # would log a confusing note about error files for this process.
            torchrun.run(torchrun.parse_args(torchrun_argv(plan, node, args)))
        except ChildFailedError as failed:
            print(f"zengine: the launch failed{failed}", file=sys.stderr)
            _, first = failed.get_first_failure()
            return _exit_code(first.exitcode)
        except SignalException as stopped:
            return 128 + int(stopped.sigval)
    return 0


def run_remote(commands: Sequence[list[str]]) -> int:
    """Start every host's ssh command and wait for all; return the first failing exit code."""
    procs = [subprocess.Popen(cmd) for cmd in commands]
    try:
        codes = [proc.wait() for proc in procs]
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()
        return 130
    return next((_exit_code(code) for code in codes if code != 0), 0)


def _visible_devices(gpu_count: int) -> list[str] | None:
    if gpu_count == 0:
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",")][:gpu_count]
    return [str(i) for i in range(gpu_count)]


def _load_hostfile(args: argparse.Namespace) -> dict[str, int] | None:
    """The hosts of ``--hostfile``, else of the default hostfile if it exists, else ``None``."""
    if args.hostfile is not None:
        if args.node_rank is not None:
            raise LaunchError(
                "--node_rank is for starting nodes by hand without a hostfile; "
                "with --hostfile the launcher ranks the hosts itself"
            )
        return parse_hostfile(args.hostfile)
    # Starting a node by hand (--node_rank) ignores the cluster's default hostfile.
    if args.node_rank is None and os.path.isfile(DEFAULT_HOSTFILE):
        return parse_hostfile(DEFAULT_HOSTFILE)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zengine`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        hosts = _load_hostfile(args)
        gpu_count = torch.cuda.device_count()
        local_slots = gpu_count or os.cpu_count() or 1
        plan = plan_launch(args, hosts, local_slots, gpu_count > 0, _is_local_host)
        if plan.remote:
            check_hosts_resolve([n.host for n in plan.nodes], hosts, resolve_for_ssh)
            cwd = os.getcwd()
            exports = exported_env(os.environ, default_env_files(cwd))
            if args.launcher == "pdsh":
                if shutil.which("pdsh") is None:
                    raise LaunchError(
                        "--launcher pdsh: the pdsh command is not installed here; install it "
                        "(e.g. apt install pdsh) or use --launcher ssh"
                    )
                commands = [pdsh_command(plan, args, exports, cwd, sys.executable)]
            else:
                commands = [
                    ssh_command(plan, n, args, exports, cwd, sys.executable) for n in plan.nodes
                ]
        else:
            visible = _visible_devices(gpu_count)
            # c10d: any node may find the rendezvous hosted already
            c10d_joins = plan.num_nodes > 1 and uses_c10d(args, plan.node_range)
            if plan.nodes[0].node_rank == 0 and not c10d_joins:
                _check_port_free(plan.master_port)
    except (LaunchError, HostfileError, NodeCountError) as err:
        parser.error(str(err))

    if args.autotuning:  # trials of this same launch, then the results (zengine/autotuning/cli.py)
        from zengine.autotuning.cli import main as autotune

        world = (
            sum(n.nproc for n in plan.nodes)
            if plan.remote
            else plan.nodes[0].nproc * plan.num_nodes
        )
        argv = list(sys.argv[1:] if argv is None else argv)
        return autotune(args, argv, world, plan.nodes[0].nproc, cpu=gpu_count == 0)
    if plan.remote:
        return run_remote(commands)
    return run_local(plan, args, visible)


if __name__ == "__main__":
    sys.exit(main())
