"""MiCS's hierarchical parameter gather (``mics_hierarchical_params_gather``): across nodes once, then inside.

A flat all-gather over a shard group that spans n nodes of L ranks sends every rank's row to every other
rank: on a ring each row crosses the node boundary once per node, the rows of a node's L ranks each on
their own. In two hops the ranks with the same local rank first gather their n rows across the nodes
(a group of n ranks, one per node), then each node gathers its L ranks' results inside (a group of L
ranks): every row still reaches every rank, but a node's traffic across the boundary is its L rows once
per other node, split over L concurrent groups, and the rest moves inside the node.

A gather codec, as ``quantized.py``'s: ``start`` launches the cross-node hop asynchronously (so the
prefetch still overlaps it), ``finish`` runs the in-node hop when the first is waited for and lays the
rows out rank-major in the staging buffer, exactly as the flat gather would (the result is identical).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from ...distributed import collectives
from ...distributed.traffic import local_world_size

if TYPE_CHECKING:  # annotations only
    from ...config.zero import ZeroConfig

logger = logging.getLogger("zengine")


class TwoHopConfigError(ValueError):
    """The shard groups do not hold whole nodes."""


class TwoHopGather:
    """All-gather a shard group's staging rows in two hops (see the module doc); a
    ``gather.GatherCodec``."""

    finishes = True  # ``finish`` (the second hop) runs after the first hop's works are waited for
    values_depend_on_row = False  # exact values, in two hops

    def __init__(self, size: int, per_node: int):
        world, me = dist.get_world_size(), dist.get_rank()
        self.nodes, self.per_node = size // per_node, per_node
        rank = me % size  # in the shard group (consecutive ranks)
        self.node, self.local = rank // per_node, rank % per_node
        self.cross = self.inside = None
        for first in range(
            0, world, size
        ):  # every rank makes every group, in the same order (torch's rule)
            for local in range(per_node):
                g = dist.new_group([first + n * per_node + local for n in range(self.nodes)])
                if first <= me < first + size and self.local == local:
                    self.cross = g
            for node in range(self.nodes):
                g = dist.new_group(
                    list(range(first + node * per_node, first + (node + 1) * per_node))
                )
                if first + node * per_node <= me < first + (node + 1) * per_node:
                    self.inside = g

    def start(self, staging: torch.Tensor, ncols: int, rank: int, group) -> tuple[list, object]:
        """The hop across the nodes (asynchronous): among the ranks of this local rank."""
        width = staging.shape[1]
        across = torch.empty(
            self.nodes, width, dtype=staging.dtype, device=staging.device
        )  # [nodes, width]
        across[self.node].copy_(staging[rank])
        return collectives.all_gather_rows(across, self.node, self.cross, async_op=True), across

    def finish(self, staging: torch.Tensor, ncols: int, across: torch.Tensor) -> None:
        """The hop inside the node, then every rank's row laid out rank-major in ``staging``."""
        width = staging.shape[1]
        # [per_node, nodes * width]: row l holds local rank l's rows of every node
        inside = torch.empty(
            self.per_node, self.nodes * width, dtype=staging.dtype, device=staging.device
        )
        inside[self.local].copy_(across.view(-1))
        collectives.all_gather_rows(inside, self.local, self.inside)
        # shard rank n * per_node + l is row (n, l): inside[l] holds node n's part at column block n
        staging.view(self.nodes, self.per_node, width).copy_(
            inside.view(self.per_node, self.nodes, width).transpose(0, 1)
        )


def gather_codec_for(zero_cfg: ZeroConfig, size: int) -> Optional[TwoHopGather]:
    """The two-hop codec when ``mics_hierarchical_params_gather`` asks for it and the shard group of ``size``
    ranks spans nodes (``LOCAL_WORLD_SIZE`` ranks each); None otherwise (one node: a flat gather is one hop)."""
    if not getattr(zero_cfg, "mics_hierarchical_params_gather", False) or size <= 1:
        return None
    per_node = max(1, local_world_size())
    if per_node >= size:
        if dist.get_rank() == 0:
            logger.info(
                "mics_hierarchical_params_gather: each shard group (%d ranks) is inside one node of %d: "
                "the flat gather is already one hop",
                size,
                per_node,
            )
        return None
    if size % per_node:
        raise TwoHopConfigError(
            f"mics_hierarchical_params_gather: a shard group of {size} ranks (mics_shard_size) "
            f"must hold whole nodes of {per_node} ranks (LOCAL_WORLD_SIZE)"
        )
    return TwoHopGather(size, per_node)
