"""Assembling the stage-3 optimizer: shard the module's parameters, decide where states live, and
build each part with what it needs, in dependency order.

    ShardedParam per parameter -> Placement (needs the shard sizes) -> Fetcher (reads ahead from the
    parameter swap file, if any) -> the groups (laid out as the placement aligns them) -> the master
    store, which the placement builds (ZeRO-Infinity's swap records need the groups) -> the gradient
    store the master store takes (ZeRO-Infinity: into its sink) -> Stage3Optimizer (the wrapped
    optimizer is made inside, over the masters)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn

from ...device import reuses_freed_blocks
from ...offload.placement import make_placement
from ...precision.grad_factor import GradFactor
from ...precision.masters import MasterPrecision
from ..bucket_order import registration_positions
from ..grad_dtypes import GradDtypes
from ..grads import buckets_in_flight
from ..init import warn_lost_writes
from ..mics import MicsConfigError
from ..optimizer import ShardGroup, StepRules
from ..sub_groups import GroupMap, bucket_sub_groups, split_sub_groups
from .fetcher import Fetcher, compute_codec
from .hierarchical import secondary_partition
from .trace import read_ahead_for
from .grads import Stage3GradSpec, stage3_gradients, swapped_stage3_gradients
from .leaf import mark_from_config
from .group import ShardedParamGroup
from .optimizer import ShardedModel, Stage3Optimizer
from .param import ParamState, ShardedParam, lookup, register
from .units import GatherUnits

if TYPE_CHECKING:  # annotations only
    from ...config import ZengineConfig
    from ...config.zero import ZeroConfig


def shard_parameters(
    module: nn.Module, zero_cfg: ZeroConfig, dtype: torch.dtype, ranks: ShardGroup
) -> list[ShardedParam]:
    """Every parameter of ``module`` as a ``ShardedParam`` (those ``zero.Init`` partitioned already keep
    theirs, gathered in the compute dtype), with its persistence decided."""
    out = []
    for name, p in module.named_parameters():
        sp = lookup(p)
        if sp is None:
            sp = ShardedParam(name, p, ranks.world, ranks.rank)
            register(sp)
        elif sp.world != ranks.world:
            raise MicsConfigError(
                f"{name}: zero.Init partitioned it over {sp.world} ranks, but this engine shards over {ranks.world} "
                f"(mics_shard_size): pass the same config to zero.Init (config_dict_or_path=ds_config) or use "
                f"zengine.zero.MiCS_Init"
            )
        sp.name = name
        if sp.state is ParamState.SHARDED:  # partitioned by zero.Init: gather in the compute dtype
            sp.retype(dtype, ranks.device)
        sp.persistent = (
            sp.numel <= zero_cfg.stage3_param_persistence_threshold
        )  # p is empty when Init sharded it
        out.append(sp)
    warn_lost_writes(
        out, "zengine.initialize"
    )  # e.g. model.apply(init) after zero.Init, on empty parameters
    return out


# At most this many groups per param group when cut into gradient buckets: each group costs the step
# its own kernels and bookkeeping, and a thirty-second of the gradient shard at a time is fine enough.
MAX_BUCKET_UNITS = 32


def optimizer_units(
    members: list[list[ShardedParam]],
    hypers: list[dict],
    cut: Optional[Callable[[list[ShardedParam]], list[list[int]]]],
) -> tuple[list[list[ShardedParam]], list[dict], GroupMap]:
    """The groups the optimizer steps and their param groups: the param groups themselves, or each
    cut into sub-groups (``cut(params)``: the indices of each, ``unit_cut``)."""
    if cut is None:
        return members, hypers, GroupMap.identity(len(members))
    units, unit_hypers, owner = [], [], []
    for pg, (sps, hyper) in enumerate(zip(members, hypers)):
        for run in cut(sps):
            units.append([sps[i] for i in run])
            unit_hypers.append(hyper)
            owner.append(pg)
    return units, unit_hypers, GroupMap(tuple(owner))


def unit_cut(
    zero_cfg: ZeroConfig, ranks: ShardGroup, dtypes: GradDtypes
) -> Optional[Callable[[list[ShardedParam]], list[list[int]]]]:
    """How the param groups are cut into the groups the optimizer steps (``sub_groups.py``): with
    partial offload (``offload_optimizer.ratio`` below 1) into DeepSpeed's sub-groups, which the
    placement splits between device and host; with the optimizer on a device that reuses freed
    blocks, into the gradient buckets, so that the gradient shards are made bucket by bucket as
    backward goes; else not (None)."""
    offload = zero_cfg.offload_optimizer
    if offload.partial:
        size = int(zero_cfg.sub_group_size)
        return lambda sps: split_sub_groups([sp.chunk for sp in sps], size)
    if offload.device == "none" and reuses_freed_blocks(ranks.device):
        # shard elements a bucket holds, as RankMajor counts them
        bucket = max(1, GatherUnits.from_config(zero_cfg).reduce_bucket // ranks.world)

        def cut(sps: list[ShardedParam]) -> list[list[int]]:
            chunks = [sp.chunk for sp in sps]
            # buckets taken together where they are many (Hugging Face's "auto" bucket is d^2)
            size = max(bucket, -(-sum(chunks) // MAX_BUCKET_UNITS))
            return bucket_sub_groups(chunks, size, dtypes.wires([sp.param for sp in sps]))

        return cut
    return None


def build_stage3_optimizer(
    module: nn.Module,
    config: ZengineConfig,
    named_groups: Sequence,
    make_optimizer: Callable,
    grad_factor: GradFactor,
    rules: StepRules,
    ranks: ShardGroup,
    on_unbracketed_grad: Callable[[], None],
    dtypes: GradDtypes,
) -> Stage3Optimizer:
    """The stage-3 optimizer over ``module`` for ``config`` (a ``ZengineConfig``); arguments as
    ``stages.build_zero_optimizer``'s (``dtypes``: the gradients' ``GradDtypes``)."""
    zero_cfg, dtype = config.zero_optimization, config.compute_dtype
    all_sharded = shard_parameters(module, zero_cfg, dtype, ranks)
    mark_from_config(
        module, zero_cfg.leaf_module
    )  # (ModuleHooks, made by the optimizer, reads the marks)
    members = [[lookup(p) for _, p in named] for named, _ in named_groups]
    members, hypers, group_map = optimizer_units(
        members, [hyper for _, hyper in named_groups], unit_cut(zero_cfg, ranks, dtypes)
    )
    chunks = [[sp.chunk for sp in sps] for sps in members]
    precision = MasterPrecision.from_config(config)
    placement = make_placement(zero_cfg, ranks.device, dtype, config.aio, chunks, precision)
    home = placement.params
    fetcher = Fetcher(
        zero_cfg,
        ranks.world,
        ranks.rank,
        ranks.device,
        ranks.group,
        read_ahead=read_ahead_for(home.swap),  # offload_param nvme: from the swap file
        secondary=secondary_partition(zero_cfg, ranks.world, ranks.rank),  # hpZ
        codec=compute_codec(zero_cfg, ranks.world),
    )  # MiCS's two hops, ZeRO++'s int8
    align = placement.alignment(dtype)
    # MiCS: only copy 0 counts in the norm and writes checkpoints
    on_home = dict(
        device=home.shard_device,
        refresh=fetcher.gather_now,
        pin=home.pin,
        primary=ranks.replication.primary,
    )
    # a trained group's shard is its fp32 master where both live on the device (the gathers cast)
    groups = [
        ShardedParamGroup(
            sps, hyper, placement.shard_dtype(gi, dtype), swap=home.swap, align=align, **on_home
        )
        for gi, (sps, hyper) in enumerate(zip(members, hypers))
    ]
    in_groups = {id(sp) for g in groups for sp in g.sharded}
    frozen_sps = [sp for sp in all_sharded if id(sp) not in in_groups]
    frozen = ShardedParamGroup(frozen_sps, {}, dtype, **on_home)  # no master: the compute dtype
    for sp in all_sharded:
        if not sp.persistent and sp.state is ParamState.GATHERED:
            sp.free()
    masters = placement.master_store(groups, dtype, ranks.world, ranks.device)  # (Infinity: a sink)
    spec = Stage3GradSpec(
        groups=groups,
        bucket_numel=GatherUnits.from_config(zero_cfg).reduce_bucket,  # ("auto": about a block)
        world=ranks.world,
        rank=ranks.rank,
        placement=placement.optimizer,
        after_grad=lambda sp: fetcher.release([sp], force=True),
        dtypes=dtypes,
        comm_group=ranks.group,
        in_flight=buckets_in_flight(zero_cfg.overlap_comm, ranks.dp_world),
        quantized_bits=zero_cfg.zero_quantized_gradients_bits
        if zero_cfg.zero_quantized_gradients
        else 0,
        replication=ranks.replication,
        positions=registration_positions(module, groups),
    )  # the buckets' launch order over the groups
    grads = masters.gradient_store(
        lambda: stage3_gradients(spec), lambda sink: swapped_stage3_gradients(spec, sink)
    )
    cpu = placement.optimizer.cpu_optimizer
    return Stage3Optimizer(
        ShardedModel(module, fetcher, all_sharded, frozen),
        groups,
        grads,
        placement,
        masters,
        lambda g: make_optimizer(g, cpu),
        grad_factor,
        rules,
        ranks,
        on_unbracketed_grad,
        group_map=group_map,
    )
