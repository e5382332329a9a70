"""How the ranks of a launch meet, and how many machines a job may run on.

A fixed job (no restarts, a fixed node count) uses torch's static rendezvous at the master, with
the node ranks given. Restarts (``--max_restarts``) and elastic node counts (``--nnodes MIN:MAX``,
or DeepSpeed's ``--min_elastic_nodes/--max_elastic_nodes``) use torch's c10d rendezvous, run by
``torch.distributed.run``'s elastic agent: each round numbers the nodes that joined, a node that
dies fails the round's workers (their collectives lose a peer) and the agents meet again with the
nodes that are left, as long as there are at least MIN, and a node that joins later makes the
agents restart their workers with it. The training script resumes from its latest checkpoint at
whatever world size the round has (``auto_resume``; checkpoints reshard on load).

Every c10d round gets a store of its own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): torch's
default keeps one worker store for all rounds, where a round that only changes membership (a
late node) reuses the previous round's keys, and a node that joins later waits forever for the
store address the first node published in an earlier round (seen with torch 2.13: both agents
time out after a minute).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class NodeCountError(ValueError):
    """A node count or range the launcher cannot run."""


@dataclass(frozen=True)
class NodeRange:
    """How many machines the job runs on: exactly ``max_nodes``, or anywhere in [min, max]."""

    min_nodes: int
    max_nodes: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    def torchrun_value(self) -> str:
        """torchrun's ``--nnodes`` value."""
        return f"{self.min_nodes}:{self.max_nodes}" if self.elastic else str(self.max_nodes)


def parse_nnodes(text: str) -> NodeRange:
    """``"N"`` or ``"MIN:MAX"`` (torchrun's ``--nnodes``)."""
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise NodeCountError(
            f"--nnodes {text!r}: expected a node count N or a range MIN:MAX, e.g. 1:4"
        ) from None
    if low < 1 or high < low:
        raise NodeCountError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return NodeRange(low, high)


def requested_range(args: argparse.Namespace) -> NodeRange | None:
    """The node count or range the options ask for (``None``: not given; the plan decides)."""
    given = [
        name
        for name, value in (
            ("--nnodes", args.nnodes),
            ("--num_nodes", args.num_nodes),
            ("--min/--max_elastic_nodes", args.min_elastic_nodes or args.max_elastic_nodes),
        )
        if value
    ]
    if len(given) > 1:
        raise NodeCountError(f"{' and '.join(given)} both give the node count; use one of them")
    if args.nnodes:
        return parse_nnodes(args.nnodes)
    if args.min_elastic_nodes or args.max_elastic_nodes:
        high = args.max_elastic_nodes or args.min_elastic_nodes
        low = args.min_elastic_nodes or 1
        if low < 1 or high < low:
            raise NodeCountError(
                f"--min_elastic_nodes {low} / --max_elastic_nodes {high}: need 1 <= MIN <= MAX"
            )
        return NodeRange(low, high)
    if args.elastic_training:
        raise NodeCountError(
            "--elastic_training needs the node range: --min_elastic_nodes and --max_elastic_nodes "
            "(or --nnodes MIN:MAX)"
        )
    if args.num_nodes is not None:
        return NodeRange(args.num_nodes, args.num_nodes)
    return None


def uses_c10d(args: argparse.Namespace, nodes: NodeRange) -> bool:
    """Whether the ranks meet through the c10d rendezvous (restarts or an elastic node range)."""
    return args.max_restarts > 0 or nodes.elastic


def rendezvous_argv(
    args: argparse.Namespace, nodes: NodeRange, master_addr: str, master_port: int
) -> list[str]:
    """torchrun's rendezvous options. The static rendezvous keeps one store across restarts, so
    restarted ranks would read the dead ranks' addresses from it ("Gloo connectFullMesh failed
    ... Connection refused") or wait forever: restarts go through c10d."""
    if uses_c10d(args, nodes):
        run_id = os.environ.get(
            "ZENGINE_RUN_ID", f"zengine-{master_port}"
        )  # the same on every node
        conf = ["--rdzv_conf", args.rdzv_conf] if args.rdzv_conf else []
        return [
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{master_addr}:{master_port}",
            "--rdzv_id",
            run_id,
            *conf,
        ]
    return [
        "--rdzv_backend",
        "static",
        "--master_addr",
        master_addr,
        "--master_port",
        str(master_port),
    ]


def rendezvous_env(args: argparse.Namespace, nodes: NodeRange) -> dict[str, str]:
    """Variables the agent needs: a store per c10d round (see the module's docstring)."""
    return {SHARE_STORE_ENV: "1"} if uses_c10d(args, nodes) else {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The node-count and rendezvous options of the ``zengine`` command."""
    parser.add_argument(
        "--nnodes",
        default=None,
        help="Machines as torchrun counts them: N, or MIN:MAX for an elastic job that goes on with as few as "
        "MIN after losing machines and takes in up to MAX (c10d rendezvous; resume with auto_resume).",
    )
    parser.add_argument(
        "--elastic_training",
        action="store_true",
        help="DeepSpeed's switch for elastic jobs; the node range comes from --min/--max_elastic_nodes.",
    )
    parser.add_argument(
        "--min_elastic_nodes",
        type=int,
        default=None,
        help="Fewest machines an elastic job goes on with (DeepSpeed's name; default 1).",
    )
    parser.add_argument(
        "--max_elastic_nodes",
        type=int,
        default=None,
        help="Most machines an elastic job takes in (DeepSpeed's name).",
    )
    parser.add_argument(
        "--rdzv_conf",
        default=None,
        help="torchrun's c10d rendezvous settings, e.g. 'last_call_timeout=5,join_timeout=600' "
        "(last_call_timeout: seconds to wait for more machines once MIN have joined; default 30).",
    )
