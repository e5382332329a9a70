"""The launch plan: which hosts run the job, which slots on each, who is master
(:func:`plan_launch`), and the ``torch.distributed.run`` arguments of each node
(:func:`torchrun_argv`). Pure decisions from checked options, the hostfile and the local
device count: nothing here starts a process or reads the network."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from zengine.launcher.hostfile import resolve_resources
from zengine.launcher.options import DEFAULT_MASTER_ADDR, LaunchError
from zengine.launcher.rendezvous import NodeRange, rendezvous_argv, requested_range, uses_c10d

LOCAL_HOST = "localhost"
ENTRY_MODULE = "zengine.launcher.entry"


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
                f"--num_nodes {requested.max_nodes} but the hostfile has only "
                f"{len(resources)} host(s)"
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
        where = (
            "the address of the machine hosting the rendezvous"
            if uses_c10d(args, requested)
            else "the address of the node with --node_rank 0"
        )
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
        "--nnodes",
        plan.node_range.torchrun_value(),
        *node_rank,
        "--nproc_per_node",
        str(node.nproc),
        *rendezvous_argv(args, plan.node_range, plan.master_addr, plan.master_port),
        "--max_restarts",
        str(args.max_restarts),
        "-m",
        ENTRY_MODULE,
        args.user_script,
        *args.user_args,
    ]
