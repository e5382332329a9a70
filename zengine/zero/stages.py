"""Choose a stage's parts from the config: the one place where stages differ.

See ``optimizer.py`` for the table of what each stage is made of. Where the states live is decided
here too, once (``offload/placement.make_placement``), and handed to the parts that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
from torch import nn

from ..distributed.process_group import ProcessRank
from ..offload.placement import make_placement
from ..precision.grad_factor import GradFactor
from ..precision.masters import MasterPrecision
from .bucket_order import registration_positions
from .flat_group import FlatParamGroup
from .grad_dtypes import GradDtypes
from .flat_buckets import sharded_gradients
from .grads import FullGradients, buckets_in_flight
from .nonfinite import NonFinitePolicy
from .mics import sharding
from .optimizer import ShardGroup, StepRules, ZeroOptimizer

if TYPE_CHECKING:  # annotations only
    from ..config import ZengineConfig
    from ..config.zero import ZeroConfig


def shard_group(zero_cfg: ZeroConfig, process_rank: ProcessRank) -> ShardGroup:
    """The ranks the model states are sharded over, from this process's rank record: all ranks
    of the default group, or with MiCS (``mics_shard_size``) this rank's shard group, the copies
    across groups in ``ShardGroup.replication``."""
    world, rank = process_rank.world_size, process_rank.rank
    size, shard_rank, group, replication = sharding(zero_cfg, world, rank)
    return ShardGroup(size, shard_rank, process_rank.device, group, replication)


def build_zero_optimizer(
    module: nn.Module,
    config: ZengineConfig,
    named_groups: Sequence[tuple[list[tuple[str, nn.Parameter]], dict]],
    make_optimizer: Callable,
    grad_factor: GradFactor,
    ranks: ShardGroup,
    on_unbracketed_grad: Callable[[], None] = lambda: None,
    wire_dtypes: Mapping[int, torch.dtype] = {},
) -> ZeroOptimizer:
    """Flatten each group's trainable parameters and assemble the optimizer for the config's stage.

    ``config`` is the whole ``ZengineConfig`` (its ``zero_optimization``, ``aio``, ``compute_dtype``,
    ``gradient_clipping``, ``nonfinite_gradients`` and, through ``GradDtypes``, ``communication_data_type``
    and ``data_types`` are read here). ``named_groups`` holds, per
    optimizer param group, its (name, parameter) pairs and its hyper-parameters.
    ``make_optimizer(groups, cpu_offload)`` builds the wrapped optimizer over the flat master shards.
    ``grad_factor``: what the step multiplies the summed gradients by (precision/grad_factor.py).
    ``on_unbracketed_grad``: see ``ZeroOptimizer``. ``wire_dtypes``: ``id(parameter) -> dtype``
    its gradient is reduced in, where not the reduce dtype (``ForwardPrecision.wire_dtypes``).
    """
    zero_cfg, dtype = config.zero_optimization, config.compute_dtype
    nonfinite = config.nonfinite_gradients
    rules = StepRules(
        config.gradient_clipping,
        NonFinitePolicy(
            nonfinite.skip, nonfinite.max_consecutive_skips, nonfinite.warn_every, ranks.dp_rank
        ),
        zero_cfg.allgather_bucket_size,
    )
    dtypes = GradDtypes.from_config(config, wire_dtypes, ranks.dp_world)
    if zero_cfg.stage == 3:
        from .stage3.build import build_stage3_optimizer  # stage 3's parts load only when used

        return build_stage3_optimizer(
            module,
            config,
            named_groups,
            make_optimizer,
            grad_factor,
            rules,
            ranks,
            on_unbracketed_grad,
            dtypes,
        )
    num_shards = 1 if zero_cfg.stage == 0 else ranks.world
    precision = MasterPrecision.from_config(config)
    placement = make_placement(zero_cfg, ranks.device, dtype, config.aio, (), precision)
    groups = [
        FlatParamGroup(named, hyper, num_shards, ranks.rank, dtype, ranks.device)
        for named, hyper in named_groups
    ]
    in_flight = buckets_in_flight(zero_cfg.overlap_comm, ranks.dp_world)
    positions = registration_positions(module, groups)  # the buckets' launch order over the groups
    if zero_cfg.stage == 2:
        grads = sharded_gradients(
            groups,
            bucket_numel=zero_cfg.reduce_bucket_size,
            dtypes=dtypes,
            to_owners=zero_cfg.reduce_scatter,
            placement=placement.optimizer,
            comm_group=ranks.group,
            in_flight=in_flight,
            positions=positions,
        )
    else:
        grads = FullGradients(
            groups,
            zero_cfg.reduce_bucket_size,
            dtypes,
            ranks.group,
            in_flight,
            positions,
            held_divisor=grad_factor.held_divisor,  # .grad holds torch's mean gradient
        )
    cpu = placement.optimizer.cpu_optimizer
    masters = placement.master_store(groups, dtype, ranks.world, ranks.device)
    return ZeroOptimizer(
        groups,
        grads,
        placement,
        masters,
        lambda g: make_optimizer(g, cpu),
        grad_factor,
        rules,
        ranks,
        on_unbracketed_grad,
    )
