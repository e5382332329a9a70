"""Reaching the other hosts of a hostfile job: the ``ssh`` command of each host
(:func:`ssh_command`) or one ``pdsh`` command for all (:func:`pdsh_command`), each starting
``cd CWD && env ... python -m torch.distributed.run ...`` there, and the check that ssh finds
an address for a host from here (:func:`resolve_for_ssh`). A host that starts with ``-`` is
never handed to ssh or pdsh, which would read it as an option."""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
from collections.abc import Mapping

from zengine.launcher.environment import worker_env
from zengine.launcher.options import LaunchError
from zengine.launcher.plan import LaunchPlan, NodePlan, torchrun_argv
from zengine.launcher.rendezvous import rendezvous_env


def _remote_torchrun(
    plan: LaunchPlan,
    node: NodePlan,
    args: argparse.Namespace,
    exports: Mapping[str, str],
    cwd: str,
    python: str,
    node_rank: str | None = None,
) -> str:
    """The shell line that starts ``node``'s torchrun on its host (``node_rank``: a stand-in for
    the node rank, such as pdsh's ``%n``)."""
    # On a remote host, hostfile slots are that host's device indices.
    devices = [str(i) for i in range(max(node.slots) + 1)]
    env = {**exports, **worker_env(node, args, devices), **rendezvous_env(args, plan.node_range)}
    torchrun = torchrun_argv(plan, node, args)
    if node_rank is not None and "--node_rank" in torchrun:  # c10d ranks the nodes itself
        torchrun[torchrun.index("--node_rank") + 1] = node_rank
    return " ".join(
        [
            "cd",
            shlex.quote(cwd),
            "&&",
            "env",
            *(shlex.quote(f"{key}={value}") for key, value in env.items()),
            shlex.quote(python),
            "-u",
            "-m",
            "torch.distributed.run",
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
    """The ``ssh`` argv that starts ``node``'s torchrun on its host (``--``: the host is never
    an option)."""
    port = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
    return ["ssh", *port, "--", node.host, _remote_torchrun(plan, node, args, exports, cwd, python)]


def pdsh_command(
    plan: LaunchPlan,
    args: argparse.Namespace,
    exports: Mapping[str, str],
    cwd: str,
    python: str,
) -> list[str]:
    """One ``pdsh`` argv that starts torchrun on every host; pdsh puts each host's index in the
    host list where the command says ``%n`` (its ``--node_rank``), as DeepSpeed's pdsh runner
    does."""
    if len({n.slots for n in plan.nodes}) > 1:
        used = ", ".join(f"{n.host}: {list(n.slots)}" for n in plan.nodes)
        raise LaunchError(
            "--launcher pdsh runs one command on every host, but the hosts use different slots "
            f"({used}); use --launcher ssh"
        )
    odd = [n.host for n in plan.nodes if n.host.startswith(("-", "^", "/")) or "," in n.host]
    if odd:  # pdsh's -w list: a leading '-' excludes, '^' names a file, '/' filters, ',' separates
        raise LaunchError(
            f"--launcher pdsh: pdsh would not read {', '.join(map(repr, odd))} as host names; "
            "correct them, or use --launcher ssh"
        )
    remote = _remote_torchrun(plan, plan.nodes[0], args, exports, cwd, python, node_rank="%n")
    ssh_args = [f"PDSH_SSH_ARGS_APPEND=-p {args.ssh_port}"] if args.ssh_port is not None else []
    return [
        "env",
        "PDSH_RCMD_TYPE=ssh",
        *ssh_args,
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        ",".join(n.host for n in plan.nodes),
        remote,
    ]


def _ssh_destination(host: str) -> str | None:
    """The name ssh connects to for ``host`` (an ssh config alias becomes its HostName), read
    with ``ssh -G``, which only prints the configuration; None when ssh goes through a ProxyJump
    or ProxyCommand, which resolve the name elsewhere. Without a working ``ssh -G``: ``host``."""
    if host.startswith("-"):  # not a host name, and never an option for ssh
        return host
    try:
        shown = subprocess.run(
            ["ssh", "-G", host],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
        )
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
    """Raise ``socket.gaierror`` (an OSError) when ssh finds no address for ``host`` from here."""
    destination = _ssh_destination(host)
    if destination is not None:
        socket.getaddrinfo(destination, None)
