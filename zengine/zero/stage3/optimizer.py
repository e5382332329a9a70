"""The stage-3 optimizer: parameters sharded too, gathered by module hooks.

The boundary step is ``ZeroOptimizer.step`` unchanged; what stage 3 adds is
who holds the parameters (``ShardedParam``), how gradients reach the shards
(``Stage3Gradients``), and the hooks and fetcher that make parameters whole
only while a module runs.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

from ...distributed import collectives
from ..grads import buckets_in_flight
from ...offload.placement import NVMePlacement, make_aio, make_placement
from ..optimizer import ZeroOptimizer
from .fetcher import Fetcher
from .grads import Stage3Gradients
from .group import ShardedParamGroup
from .hooks import ModuleHooks
from ...offload.infinity import MasterIO
from ...offload.param_swap import ParamSwap, align_elems, on_disk, round_up
from .param import ParamState, ShardedParam, lookup, register

WRITE_CHUNK = 1 << 24  # elements per write when shards on NVMe are refreshed from masters in memory


class Stage3Optimizer(ZeroOptimizer):
    """ZeroOptimizer over stage-3 groups, with the hooks that gather parameters on demand."""

    def __init__(self, module: nn.Module, zero_cfg, named_groups: Sequence, make_optimizer: Callable, scaler,
                 clip: float, dtype: torch.dtype, device: torch.device, rank: int, world: int, comm_group=None,
                 aio_cfg=None):
        placement = make_placement(zero_cfg, device, aio_cfg)
        self.module = module
        self.fetcher = Fetcher(zero_cfg, world, rank, device, comm_group)
        self.all_sharded: list[ShardedParam] = []
        for name, p in module.named_parameters():
            sp = lookup(p)
            if sp is None:
                sp = ShardedParam(name, p, world, rank)
                register(sp)
            sp.name = name
            sp.owner = self
            if sp.state is ParamState.SHARDED:  # partitioned by zero.Init: gather in the compute dtype
                sp.retype(dtype, device)
            sp.persistent = sp.numel <= zero_cfg.stage3_param_persistence_threshold  # p is empty when Init sharded it
            self.all_sharded.append(sp)
        # offload_param: the shards live in host memory (cpu) or in a swap file (nvme, offload/param_swap.py); the fetcher
        # copies each up as it gathers, and the optimizer writes the updated shards back.
        offload = zero_cfg.offload_param.device in ("cpu", "nvme")
        shard_device = torch.device("cpu") if offload else device  # host memory by design with offload_param
        pin = offload and bool(zero_cfg.offload_param.pin_memory) and device.type == "cuda"  # pinned for copies up
        # ZeRO-Infinity: with the optimizer on NVMe the masters and gradients are swapped with the moments
        swapped_masters = isinstance(placement, NVMePlacement)
        align = align_elems(dtype) if swapped_masters or zero_cfg.offload_param.device == "nvme" else 1
        members = [[lookup(p) for _, p in named] for named, _ in named_groups]
        self.param_swap = None
        if zero_cfg.offload_param.device == "nvme":
            sizes = [sum(round_up(sp.chunk, align) for sp in sps) + align for sps in members]  # as the groups lay out
            self.param_swap = ParamSwap(zero_cfg.offload_param, dtype, make_aio(aio_cfg), device, sizes)
            self.fetcher.swap = self.param_swap
        groups = [ShardedParamGroup(sps, hyper, dtype, shard_device, self.fetcher.gather_now, pin, self.param_swap,
                                    align) for sps, (_, hyper) in zip(members, named_groups)]
        self.infinity = MasterIO(groups, dtype) if swapped_masters else None
        placement.infinity = self.infinity
        in_groups = {id(sp) for g in groups for sp in g.sharded}
        self.frozen = ShardedParamGroup([sp for sp in self.all_sharded if id(sp) not in in_groups], {}, dtype,
                                        shard_device, self.fetcher.gather_now, pin)
        for sp in self.all_sharded:
            if not sp.persistent and sp.state is ParamState.GATHERED:
                sp.free()
        grads = Stage3Gradients(groups, zero_cfg.reduce_bucket_size, world, rank, placement,
                                lambda sp: self.fetcher.release([sp], force=True), comm_group,
                                buckets_in_flight(zero_cfg.overlap_comm), swapped=swapped_masters)
        super().__init__(groups, grads, placement, lambda g: make_optimizer(g, placement.cpu_optimizer), scaler,
                         clip, zero_cfg.allgather_bucket_size, world, rank, device, comm_group)
        if swapped_masters:
            grads.sink = self.optimizer.grads
            self._grad_shapes = [on_disk() for _ in self.masters]  # what the step's .grad shows
        self._resident_depth = 0
        self.module_hooks = ModuleHooks(module, self.fetcher)

    @contextlib.contextmanager
    def states_resident(self):
        """As ZeroOptimizer's; ZeRO-Infinity's masters are read in too (``masters`` shows them inside)."""
        self._resident_depth += 1
        try:
            with super().states_resident():
                if self.infinity is not None and self._resident_depth == 1:
                    self.masters = [p.detach() for p in self.shard_params]  # the values SwappedAdam read in
                try:
                    yield
                finally:
                    if self.infinity is not None and self._resident_depth == 1:
                        self.masters = [on_disk() for _ in self.shard_params]
        finally:
            self._resident_depth -= 1

    # -- ZeRO-Infinity and parameters on NVMe: the step's pieces ----------------------------------
    def _make_master(self, group: ShardedParamGroup) -> torch.Tensor:
        if self.infinity is not None:  # in the swap file; values only inside states_resident()
            return on_disk()
        if not group.in_memory:
            master = self.placement.empty(group.shard_numel, torch.float32, self.device)
            group.read_into(master, WRITE_CHUNK)
            return master
        return super()._make_master(group)

    def _master_grads(self) -> list[torch.Tensor]:
        if self.infinity is None:
            return super()._master_grads()
        self.optimizer.grad_scale = 1.0 / (self.world * self.scaler.scale)  # applied chunk by chunk in the step
        return self._grad_shapes

    def _sq_norm(self, master_grads: list[torch.Tensor]) -> torch.Tensor:
        if self.infinity is None:
            return super()._sq_norm(master_grads)
        return self.grads.swapped_sq() * self.optimizer.grad_scale ** 2

    def _clip_grads(self, master_grads: list[torch.Tensor], coef: float) -> None:
        if self.infinity is None:
            super()._clip_grads(master_grads, coef)
        else:
            self.optimizer.grad_scale *= coef

    def _where_nonfinite(self, master_grads: list[torch.Tensor]):
        if self.infinity is None:
            return super()._where_nonfinite(master_grads)
        return super()._where_nonfinite([self.grads.owned_grad(gi) for gi in range(len(self.groups))])

    def _state_tensors(self, gi: int) -> list[torch.Tensor]:
        # ZeRO-Infinity keeps unused ranges itself (keep_unchanged): the master has no storage here
        return [] if self.infinity is not None else super()._state_tensors(gi)

    def _copy_out_targets(self) -> dict:
        if self.infinity is not None or self.param_swap is not None:
            return {}  # the swapped step writes the parameters itself; NVMe shards are written by write_back
        return super()._copy_out_targets()

    def write_back(self, skip_copy: bool = False) -> None:
        if self.infinity is None and self.param_swap is not None:  # masters in memory, shards on NVMe
            for g, master in zip(self.groups, self.masters):
                g.write_from(master, WRITE_CHUNK)
        # ZeRO-Infinity's step (and states_resident) wrote the parameters already
        super().write_back(skip_copy or self.infinity is not None or self.param_swap is not None)

    # -- forward and backward -------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self):
        self.fetcher.begin_step(torch.is_grad_enabled() and self.module.training)
        with self.module_hooks.mode():
            yield

    def end_backward(self) -> None:
        super().end_backward()
        self.release_all()
        self.fetcher.end_step()
        self.module_hooks.backward_done()

    def close(self) -> None:
        super().close()
        self.fetcher.drain()
        self.module_hooks.remove()
        if self.param_swap is not None:
            self.param_swap.close()

    def release_all(self) -> None:
        """Free every gathered parameter that is not persistent or held by a context."""
        self.fetcher.release([sp for sp in self.all_sharded if sp.state is ParamState.GATHERED], force=True)

    # -- full parameters on request -------------------------------------------------------------
    def sync_masters(self) -> None:
        """Copy the compute-dtype shards into separate fp32 masters (after shards were written)."""
        with torch.no_grad(), self.states_resident():
            for g, master in zip(self.groups, self.masters):
                if not g.in_memory:
                    g.read_into(master, WRITE_CHUNK)
                elif master.data_ptr() != g.shard_flat.data_ptr():
                    master.copy_(g.shard_flat)

    def refresh_param(self, gi: int, pi: int, value: torch.Tensor) -> None:
        """After ``safe_set_full_fp32_param`` (the shard is already written): a parameter that stays
        gathered shows ``value`` too."""
        g = self.groups[gi]
        sp = g.sharded[pi]
        if not g.in_memory:  # the NVMe shard from the master just set (inside states_resident)
            off = g.offsets[pi]
            sp.store.write_shard(sp, self.masters[gi][off:off + sp.chunk])
        if sp.state is ParamState.GATHERED:
            with torch.no_grad():
                sp.full.narrow(0, 0, sp.numel).copy_(value.reshape(-1))

    @contextlib.contextmanager
    def full_params(self, params: Sequence[ShardedParam], modifier_rank=None, writeback: bool = False,
                    rank0_only: bool = False, offload_to_cpu: bool = False):
        """Gather ``params`` whole for the duration; see Engine.summon_full_params and zero.GatheredParameters."""
        params = list(params)
        self.fetcher.gather_now([sp for sp in params if sp.state is ParamState.GATHERED])
        self.fetcher.fetch([sp for sp in params if sp.state is ParamState.SHARDED], "gathered parameters")
        for sp in params:
            sp.pinned = True
        saved = {}
        if offload_to_cpu or rank0_only:
            for sp in params:
                saved[id(sp)] = sp.param.data
                keep = (not rank0_only) or self.rank == 0
                sp.param.data = (sp.param.data.to("cpu", copy=True) if offload_to_cpu else sp.param.data) if keep \
                    else torch.empty(0, dtype=sp.full.dtype, device=sp.full.device)
        try:
            yield
        finally:
            if saved:
                for sp in params:
                    view = saved[id(sp)]
                    if writeback and (not rank0_only or self.rank == 0) and offload_to_cpu:
                        view.copy_(sp.param.data)
                    sp.param.data = view
            if modifier_rank is not None:
                for sp in params:
                    collectives.broadcast(sp.full, modifier_rank, self.comm_group)
            if modifier_rank is not None or writeback:
                if rank0_only and writeback and modifier_rank is None:
                    for sp in params:
                        collectives.broadcast(sp.full, 0, self.comm_group)
                for sp in params:
                    sp.write_back_full()
                self.sync_masters()
            for sp in params:
                sp.pinned = False
            self.fetcher.release(params, force=True)
            self.fetcher.drop_staging()

    @contextlib.contextmanager
    def summon(self, writeback: bool = True, rank0_only: bool = False, offload_to_cpu: bool = False,
               with_grads: bool = False):
        with self.full_params(self.all_sharded, writeback=writeback, rank0_only=rank0_only,
                              offload_to_cpu=offload_to_cpu):
            if with_grads:
                self._gather_grads()
            try:
                yield
            finally:
                if with_grads:
                    for g in self.groups:
                        for p in g.params:
                            p.grad = None

    def _gather_grads(self) -> None:
        """Give every trainable parameter its whole reduced gradient (the mean over ranks, unscaled)."""
        factor = 1.0 / (self.world * self.scaler.scale)
        for gi, g in enumerate(self.groups):
            shard = self.grads.owned_grad(gi)
            for sp, off in zip(g.sharded, g.offsets):
                # [world, chunk] on the compute device: with optimizer offload the shard is on the host,
                # and NCCL gathers only device tensors
                staging = torch.empty(self.world, sp.chunk, dtype=shard.dtype, device=self.device)
                staging[self.rank].copy_(shard[off:off + sp.chunk])
                collectives.all_gather_rows(staging, self.rank, self.comm_group)
                sp.param.grad = (staging.view(-1)[:sp.numel] * factor).view(sp.shape).to(sp.full.dtype)

    def memory_tensors(self):
        kinds = super().memory_tensors()
        kinds["parameters"] = kinds["parameters"] + self.frozen.tensors()
        if self.param_swap is not None:
            kinds["parameters"] += self.param_swap.host_buffers()
        return kinds
