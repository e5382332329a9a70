"""Choose a stage's parts from the config: the one place where stages differ.

See ``optimizer.py`` for the table of what each stage is made of.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ..precision.loss_scaler import LossScaler
from .flat_group import FlatParamGroup
from .grads import FullGradients, ShardedGradients, buckets_in_flight
from ..offload.placement import make_placement
from .optimizer import ZeroOptimizer


def build_zero_optimizer(module: nn.Module, zero_cfg, named_groups: Sequence[tuple[list[tuple[str, nn.Parameter]], dict]],
                         make_optimizer: Callable, scaler: LossScaler, clip: float, dtype: torch.dtype,
                         device: torch.device, rank: int, world: int, comm_group=None, aio_cfg=None) -> ZeroOptimizer:
    """Flatten each group's trainable parameters and assemble the optimizer for ``zero_cfg.stage``.

    ``named_groups`` holds, per optimizer param group, its (name, parameter)
    pairs and its hyper-parameters. ``make_optimizer(groups, cpu_offload)``
    builds the wrapped optimizer over the flat master shards. ``aio_cfg`` (the
    ``aio`` section) sets the file I/O of NVMe offload.
    """
    stage = zero_cfg.stage
    if stage == 3:
        from .stage3.optimizer import Stage3Optimizer
        return Stage3Optimizer(module, zero_cfg, named_groups, make_optimizer, scaler, clip, dtype, device, rank,
                               world, comm_group, aio_cfg)
    num_shards = 1 if stage == 0 else world
    placement = make_placement(zero_cfg, device, aio_cfg)
    groups = [FlatParamGroup(named, hyper, num_shards, rank, dtype, device) for named, hyper in named_groups]
    if stage == 2:
        use_reduce = zero_cfg.reduce_scatter and torch.distributed.get_backend(comm_group) != "gloo"
        grads = ShardedGradients(groups, zero_cfg.reduce_bucket_size, use_reduce, placement, comm_group,
                                 buckets_in_flight(zero_cfg.overlap_comm))
    else:
        grads = FullGradients(groups, zero_cfg.reduce_bucket_size, comm_group)
    return ZeroOptimizer(groups, grads, placement, lambda g: make_optimizer(g, placement.cpu_optimizer), scaler,
                         clip, zero_cfg.allgather_bucket_size, world, rank, device, comm_group)
