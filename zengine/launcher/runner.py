"""The ``zengine`` command: start a training script on every slot, like ``deepspeed``.

``zengine [options] script.py [script args]``. Process supervision, restarts
and rendezvous are ``torch.distributed.run``'s (torchrun); this module only
decides what to run where:

1. parse and check the options (every input error is reported before
   anything starts);
2. :func:`plan_launch` turns them, the hostfile and the local device count
   into a :class:`LaunchPlan`: which hosts, which slots on each, who is master;
   on several machines every host of the plan must resolve to an address
   (:func:`resolve_for_ssh`), else the launch stops there, naming it;
3. one machine: torchrun runs in this process (:func:`run_local`), with each
   rank started as ``-m zengine.launcher.entry script args`` (see ``entry.py``);
   several machines: one ``ssh -- HOST "cd CWD && env ... python -m
   torch.distributed.run ..."`` per host (:func:`ssh_command`, :func:`run_remote`).
   A host (or ``--master_addr``) that starts with ``-`` is refused before
   anything runs: ssh or pdsh would read it as an option.

How the ranks meet (static or c10d rendezvous, elastic node ranges) is ``rendezvous.py``'s.

The launcher exits with the workers' exit code.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from zengine.launcher.entry import COMPAT_ENV, NO_LOCAL_RANK_ENV, RUN_MODULE_ENV
from zengine.launcher.hostfile import (OPTION_LIKE, HostfileError, check_hosts_resolve, parse_hostfile,
                                       resolve_resources)
from zengine.launcher.rendezvous import (NodeCountError, NodeRange, add_arguments as add_rendezvous_arguments,
                                         rendezvous_argv, rendezvous_env, requested_range, uses_c10d)

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
LOCAL_HOST = "localhost"
ENTRY_MODULE = "zengine.launcher.entry"
# Variables copied from the launching shell to every remote host, as DeepSpeed does.
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "MV2_")
EXPORT_NAMES = ("PATH",)
# Files of extra KEY=VALUE lines for remote hosts, looked for in ~ then in the
# working directory (later files win).
ENV_FILE_NAMES = (".deepspeed_env", ".zengine_env")
DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]  # DeepSpeed's name of it (accelerate's launcher imports it)


class LaunchError(ValueError):
    """Options that cannot be launched; the message names the problem."""


@dataclass(frozen=True)
class NodePlan:
    """One machine's share of the job: the torchrun instance started there."""

    host: str
    node_rank: int
    slots: tuple[int, ...]  # device indices (or, on CPU, process indices) used on this host

    @property
    def nproc(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class LaunchPlan:
    """Where the job runs. ``nodes`` lists the nodes this launcher starts:
    every node when ``remote`` (over ssh), else the single local node, which may
    be one of ``num_nodes`` started by hand with ``--node_rank``."""

    nodes: tuple[NodePlan, ...]
    num_nodes: int  # the most machines the job runs on
    master_addr: str
    master_port: int
    remote: bool
    min_nodes: int | None = None  # the fewest it goes on with (elastic); None: num_nodes

    @property
    def node_range(self) -> NodeRange:
        return NodeRange(self.min_nodes or self.num_nodes, self.num_nodes)


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser; everything after the script is left to the script."""
    p = argparse.ArgumentParser(
        prog="zengine",
        description="Launch a training script on one or several machines "
        "(options as the deepspeed launcher; runs on torch.distributed.run).",
        allow_abbrev=False,
    )
    p.add_argument(
        "-H", "--hostfile", default=None,
        help="File of 'hostname slots=N' lines. Default: "
        f"{DEFAULT_HOSTFILE} if it exists, else this machine only.",
    )
    p.add_argument(
        "-i", "--include", default="",
        help="Run only on these hosts/slots, e.g. 'worker-0:0,1@worker-1'.",
    )
    p.add_argument(
        "-e", "--exclude", default="",
        help="Run on every slot except these, e.g. 'worker-1:0@worker-2'.",
    )
    p.add_argument(
        "--num_nodes", type=int, default=None,
        help="Number of machines: the first N of the hostfile, or, without "
        "one, the total started by hand with --node_rank on each.",
    )
    p.add_argument(
        "--node_rank", type=int, default=None,
        help="This machine's rank when starting each of --num_nodes machines by hand.",
    )
    p.add_argument(
        "--num_gpus", "--num_procs", "--num_accelerators", dest="num_gpus",
        type=int, default=None,
        help="Processes per machine (one per GPU). Default: every local GPU, or 1 on a CPU machine.",
    )
    p.add_argument(
        "--master_addr", default=None,
        help=f"Address of the rank-0 machine. Default: {DEFAULT_MASTER_ADDR} on "
        "one machine, the first hostfile host on several.",
    )
    p.add_argument(
        "--master_port", type=int, default=DEFAULT_MASTER_PORT,
        help=f"Port of the rendezvous store on the master (default {DEFAULT_MASTER_PORT}).",
    )
    p.add_argument(
        "--max_restarts", type=int, default=0,
        help="Restart all workers up to this many times after a failure (default 0).",
    )
    add_rendezvous_arguments(p)
    p.add_argument(
        "--comm_timeout", type=float, default=None,
        help="Seconds a collective may wait for the other ranks before every rank fails with an error "
             "(overrides the config's comm_timeout; default: the config's, 300).",
    )
    p.add_argument(
        "--no_local_rank", action="store_true",
        help="Do not pass --local_rank=N to the script (LOCAL_RANK is still set).",
    )
    p.add_argument(
        "--deepspeed_compat", "--deepspeed-compat", action="store_true",
        help="Run an unmodified DeepSpeed script: `import deepspeed` resolves to zengine in each rank.",
    )
    p.add_argument(
        "--module", action="store_true",
        help="Treat the script as a Python module name, as 'python -m' does.",
    )
    p.add_argument("--ssh_port", type=int, default=None, help="Port for ssh to remote hosts.")
    p.add_argument(
        "--launcher", choices=("ssh", "pdsh"), default="ssh",
        help="How a hostfile job reaches the other hosts: one ssh per host, or one pdsh for all of them "
        "(DeepSpeed's default; every host must use the same slots).",
    )
    p.add_argument("user_script", help="The training script (or module, with --module).")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="Arguments for the script, untouched.")
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
        raise LaunchError(f"--comm_timeout must be a positive number of seconds, got {args.comm_timeout}")
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
    try:
        requested_range(args)
    except NodeCountError as err:
        raise LaunchError(str(err)) from None
    if not args.module and not os.path.isfile(args.user_script):
        raise LaunchError(f"training script {args.user_script!r} not found")


def plan_launch(
    args: argparse.Namespace,
    hosts: dict[str, int] | None,
    local_slot_count: int,
    gpus_present: bool,
    is_local_host: Callable[[str], bool] = lambda host: False,
) -> LaunchPlan:
    """Decide hosts, slots and master from checked ``args``.

    ``hosts`` is the parsed hostfile (``None`` for this machine only).
    ``local_slot_count`` is how many slots this machine offers to
    ``--include``/``--exclude``: its GPU count, or on a CPU machine its
    core count. ``is_local_host`` tells a hostfile entry naming this machine.
    """
    if hosts is None:
        return _plan_this_machine(args, local_slot_count, gpus_present)

    resources = resolve_resources(hosts, args.include, args.exclude)
    requested = requested_range(args)
    if requested is not None:
        if requested.max_nodes > len(resources):
            raise LaunchError(
                f"--num_nodes {requested.max_nodes} but the hostfile has only {len(resources)} host(s)"
            )
        resources = dict(list(resources.items())[: requested.max_nodes])
    if args.num_gpus is not None:
        for host, slots in resources.items():
            if args.num_gpus > len(slots):
                raise LaunchError(
                    f"--num_gpus {args.num_gpus} but host {host!r} has only {len(slots)} slot(s)"
                )
        resources = {host: slots[: args.num_gpus] for host, slots in resources.items()}

    nodes = tuple(
        NodePlan(host, rank, tuple(slots)) for rank, (host, slots) in enumerate(resources.items())
    )
    if len(nodes) == 1 and is_local_host(nodes[0].host):
        return LaunchPlan(
            nodes=(NodePlan(LOCAL_HOST, 0, nodes[0].slots),),
            num_nodes=1,
            master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
            master_port=args.master_port,
            remote=False,
        )
    return LaunchPlan(
        nodes=nodes,
        num_nodes=len(nodes),
        master_addr=args.master_addr or nodes[0].host,
        master_port=args.master_port,
        remote=True,
        min_nodes=requested.min_nodes if requested is not None else None,
    )


def _plan_this_machine(
    args: argparse.Namespace, local_slot_count: int, gpus_present: bool
) -> LaunchPlan:
    requested = requested_range(args) or NodeRange(1, 1)
    num_nodes = requested.max_nodes
    node_rank = args.node_rank or 0
    if node_rank >= num_nodes:
        raise LaunchError(f"--node_rank {node_rank} must be less than --num_nodes {num_nodes}")
    if num_nodes > 1 and args.master_addr is None:
        where = ("the address of the machine hosting the rendezvous" if uses_c10d(args, requested)
                 else "the address of the node with --node_rank 0")
        raise LaunchError(
            f"--num_nodes {num_nodes} without a hostfile starts one node by hand: "
            f"give every node the same --master_addr ({where})"
        )

    if args.include or args.exclude:
        pool = {LOCAL_HOST: max(local_slot_count, 1)}
        slots = resolve_resources(pool, args.include, args.exclude)[LOCAL_HOST]
    elif args.num_gpus is not None:
        if gpus_present and args.num_gpus > local_slot_count:
            raise LaunchError(
                f"--num_gpus {args.num_gpus} but this machine has only {local_slot_count} GPU(s)"
            )
        slots = list(range(args.num_gpus))
    else:
        slots = list(range(local_slot_count if gpus_present else 1))
    return LaunchPlan(
        nodes=(NodePlan(LOCAL_HOST, node_rank, tuple(slots)),),
        num_nodes=num_nodes,
        master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
        master_port=args.master_port,
        remote=False,
        min_nodes=requested.min_nodes,
    )


def torchrun_argv(plan: LaunchPlan, node: NodePlan, args: argparse.Namespace) -> list[str]:
    """Arguments for ``torch.distributed.run`` on ``node``; each rank runs the entry shim."""
    # c10d numbers the nodes as they join; the static rendezvous takes the node rank given
    node_rank = [] if uses_c10d(args, plan.node_range) else ["--node_rank", str(node.node_rank)]
    return [
        "--nnodes", plan.node_range.torchrun_value(),
        *node_rank,
        "--nproc_per_node", str(node.nproc),
        *rendezvous_argv(args, plan.node_range, plan.master_addr, plan.master_port),
        "--max_restarts", str(args.max_restarts),
        "-m", ENTRY_MODULE,
        args.user_script,
        *args.user_args,
    ]


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


def _remote_torchrun(plan: LaunchPlan, node: NodePlan, args: argparse.Namespace, exports: Mapping[str, str],
                     cwd: str, python: str, node_rank: str | None = None) -> str:
    """The shell line that starts ``node``'s torchrun on its host (``node_rank``: a stand-in for the
    node rank, such as pdsh's ``%n``)."""
    # On a remote host, hostfile slots are that host's device indices.
    devices = [str(i) for i in range(max(node.slots) + 1)]
    env = {**exports, **worker_env(node, args, devices), **rendezvous_env(args, plan.node_range)}
    torchrun = torchrun_argv(plan, node, args)
    if node_rank is not None and "--node_rank" in torchrun:  # c10d ranks the nodes itself
        torchrun[torchrun.index("--node_rank") + 1] = node_rank
    return " ".join(
        [
            "cd", shlex.quote(cwd), "&&",
            "env", *(shlex.quote(f"{key}={value}") for key, value in env.items()),
            shlex.quote(python), "-u", "-m", "torch.distributed.run",
            *(shlex.quote(a) for a in torchrun),  # quote() leaves %n as it is
        ]
    )


def ssh_command(
    plan: LaunchPlan,
    node: NodePlan,
    args: argparse.Namespace,
    exports: Mapping[str, str],
    cwd: str,
    python: str,
) -> list[str]:
    """The ``ssh`` argv that starts ``node``'s torchrun on its host (``--``: the host is never an option)."""
    port = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
    return ["ssh", *port, "--", node.host, _remote_torchrun(plan, node, args, exports, cwd, python)]


def pdsh_command(
    plan: LaunchPlan,
    args: argparse.Namespace,
    exports: Mapping[str, str],
    cwd: str,
    python: str,
) -> list[str]:
    """One ``pdsh`` argv that starts torchrun on every host; pdsh puts each host's index in the host
    list where the command says ``%n`` (its ``--node_rank``), as DeepSpeed's pdsh runner does."""
    if len({n.slots for n in plan.nodes}) > 1:
        raise LaunchError("--launcher pdsh runs one command on every host, but the hosts use different slots "
                          f"({', '.join(f'{n.host}: {list(n.slots)}' for n in plan.nodes)}); use --launcher ssh")
    odd = [n.host for n in plan.nodes if n.host.startswith(("-", "^", "/")) or "," in n.host]
    if odd:  # pdsh's -w list: a leading '-' excludes, '^' names a file, '/' filters, ',' separates
        raise LaunchError(f"--launcher pdsh: pdsh would not read {', '.join(map(repr, odd))} as host names; "
                          "correct them, or use --launcher ssh")
    remote = _remote_torchrun(plan, plan.nodes[0], args, exports, cwd, python, node_rank="%n")
    ssh_args = [f"PDSH_SSH_ARGS_APPEND=-p {args.ssh_port}"] if args.ssh_port is not None else []
    return ["env", "PDSH_RCMD_TYPE=ssh", *ssh_args, "pdsh", "-S", "-f", "1024",
            "-w", ",".join(n.host for n in plan.nodes), remote]


def _ssh_destination(host: str) -> str | None:
    """The name ssh connects to for ``host`` (an ssh config alias becomes its HostName), read with
    ``ssh -G``, which only prints the configuration; None when ssh goes through a ProxyJump or
    ProxyCommand, which resolve the name elsewhere. Without a working ``ssh -G``: ``host``."""
    if host.startswith("-"):  # not a host name, and never an option for ssh
        return host
    try:
        shown = subprocess.run(["ssh", "-G", host], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return host
    if shown.returncode != 0:
        return host
    options: dict[str, str] = {}
    for line in shown.stdout.splitlines():
        key, _, value = line.partition(" ")
        options.setdefault(key.lower(), value.strip())
    if options.get("proxyjump", "none") != "none" or options.get("proxycommand", "none") != "none":
        return None
    return options.get("hostname", host)


def resolve_for_ssh(host: str) -> None:
    """Raise OSError (``socket.gaierror``) when ssh would find no address for ``host`` from here."""
    destination = _ssh_destination(host)
    if destination is not None:
        socket.getaddrinfo(destination, None)


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


def run_local(plan: LaunchPlan, args: argparse.Namespace, visible_devices: Sequence[str] | None) -> int:
    """Run torchrun in this process for the plan's one node; return the workers' exit code."""
    node = plan.nodes[0]
    with _environ_set({**worker_env(node, args, visible_devices), **rendezvous_env(args, plan.node_range)}):
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
                    raise LaunchError("--launcher pdsh: the pdsh command is not installed here; install it "
                                      "(e.g. apt install pdsh) or use --launcher ssh")
                commands = [pdsh_command(plan, args, exports, cwd, sys.executable)]
            else:
                commands = [ssh_command(plan, n, args, exports, cwd, sys.executable) for n in plan.nodes]
        else:
            visible = _visible_devices(gpu_count)
            if plan.nodes[0].node_rank == 0 and not (plan.num_nodes > 1 and uses_c10d(args, plan.node_range)):
                _check_port_free(plan.master_port)  # (c10d: any node may find the rendezvous hosted already)
    except (LaunchError, HostfileError, NodeCountError) as err:
        parser.error(str(err))

    if plan.remote:
        return run_remote(commands)
    return run_local(plan, args, visible)


if __name__ == "__main__":
    sys.exit(main())
