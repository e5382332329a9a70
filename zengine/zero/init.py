"""``zero.Init`` and ``zero.GatheredParameters``: stage-3 parameters outside the engine's hooks.

``Init`` partitions each module's parameters as soon as the module's
constructor returns, so that a model is never whole on any rank: building
it holds about one layer in full plus the shards. Parameters are broadcast
from rank 0 before they are cut, so every rank's shards agree.

A module's own ``self.apply(init_fn)`` at the end of its constructor (the usual custom
initialisation) meets children whose parameters are already partitioned: inside ``Init``,
``Module.apply`` gathers each module's partitioned parameters around ``fn`` and keeps rank 0's
result, as the module would have been initialised whole. A write to a partitioned parameter
by other means (``nn.init.normal_(model.fc.weight)`` after the constructor) goes nowhere; it is
seen from the parameter's version counter and named, with the way out, when ``Init`` exits and
again at ``initialize`` (``warn_lost_writes``).

``GatheredParameters`` gathers given parameters for a block of code; with
``modifier_rank=r`` what rank r wrote is copied into every rank's shard (and
the engine's fp32 masters) on exit. Outside stage 3 it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import agreement, collectives
from .mics import groups as mics_groups, sharding
from .stage3.fetcher import Fetcher
from .stage3.param import ParamState, ShardedParam, lookup
from .stage3.partition import partition

logger = logging.getLogger("zengine")


def _subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


class Init:
    """Context manager: modules built inside have their parameters partitioned as they are created.

    With ``remote_device="nvme"`` or a config (``config_dict_or_path`` / ``config``, as DeepSpeed
    takes them) whose ``offload_param.device`` is ``nvme``, each shard goes to a swap file under
    ``offload_param.nvme_path`` as its module is built, in the config's compute dtype, so the model
    is never in memory whole or sharded; the engine takes the shards over at ``initialize``."""

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device: Optional[str] = None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: Optional[torch.dtype] = None,
        **_ignored,
    ):
        self.enabled = enabled
        self._patched: list = []
        self._depth: dict[int, int] = {}
        self._config = config_dict_or_path if config_dict_or_path is not None else config
        self._remote_device = remote_device
        self._dtype = dtype
        self.swap = None  # the NVMe swap shards go to (GrowingSwap), when asked

    def __enter__(self):
        if not self.enabled:
            return self
        from ..distributed.process_group import ProcessRank, init_distributed

        init_distributed()
        cfg = self._zero_sections()
        # the ranks the engine will shard over: all of them, or with MiCS this rank's shard group (mics.py)
        zero_cfg = cfg.zero_optimization if cfg is not None else None
        self.world, self.rank, _, _ = sharding(zero_cfg, dist.get_world_size(), dist.get_rank())
        self.device = (
            ProcessRank.current().device
        )  # parameters are cut where the engine will compute with them
        self.swap = self._nvme_swap(cfg)
        self._made: list[ShardedParam] = []
        for cls in _subclasses(nn.Module):
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                self._patched.append((cls, "__init__", original))
                cls.__init__ = self._wrap(original)
        self._patched.append((nn.Module, "apply", nn.Module.apply))
        nn.Module.apply = _apply_gathered
        return self

    def __exit__(self, *exc):
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)
        self._patched = []
        if exc[0] is None and self.enabled:  # disabled (enabled=False): nothing was made
            warn_lost_writes(self._made, "zero.Init")
        return False

    def _wrap(self, original):
        init = self

        def __init__(module, *args, **kwargs):
            key = id(module)
            init._depth[key] = init._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                init._depth[key] -= 1
            if init._depth[key] == 0:  # the outermost constructor of this object has returned
                del init._depth[key]
                init._partition(module)

        __init__.__wrapped__ = original
        return __init__

    def _partition(self, module: nn.Module) -> None:
        named = [
            (f"{type(module).__name__}.{name}", p) for name, p in module._parameters.items()
        ]  # full names at initialize
        self._made += partition(named, self.device, None, self.world, self.rank, self.swap)

    def _zero_sections(self):
        """The config's sections Init reads (``None`` without a config)."""
        from ..config import load_zero_sections

        return load_zero_sections(self._config) if self._config is not None else None

    def _nvme_swap(self, cfg):
        """The GrowingSwap that ``offload_param: {device: nvme}`` (or ``remote_device="nvme"``) asks for."""
        if cfg is None and self._remote_device != "nvme":
            return None
        from ..config import ConfigError
        from ..offload.placement import make_aio
        from ..offload.param_swap import GrowingSwap

        offload = cfg.zero_optimization.offload_param if cfg is not None else None
        wants = self._remote_device == "nvme" or (offload is not None and offload.device == "nvme")
        if not wants or self._remote_device == "cpu":
            return None
        if offload is None or offload.nvme_path is None:
            raise ConfigError(
                "zero.Init(remote_device='nvme') needs a config with zero_optimization.offload_param."
                "nvme_path (pass config_dict_or_path=ds_config)"
            )
        dtype = self._dtype or (cfg.compute_dtype if cfg is not None else torch.float32)
        return GrowingSwap(offload, dtype, make_aio(cfg.aio), self.device)


class MiCS_Init(Init):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's ``zero.MiCS_Init``: ``Init`` for a MiCS config (``mics_shard_size``), which it needs to cut the
    parameters over the shard groups. ``Init`` itself reads ``mics_shard_size`` from the config too."""

    def __init__(self, *args, config_dict_or_path=None, config=None, **kwargs):
        if config_dict_or_path is None and config is None:
            from ..config import ConfigError

            raise ConfigError(
                "zero.MiCS_Init needs the config (config_dict_or_path=ds_config): its mics_shard_size "
                "says which ranks shard the parameters"
            )
        super().__init__(*args, config_dict_or_path=config_dict_or_path, config=config, **kwargs)


def _apply_gathered(module: nn.Module, fn):
    """``nn.Module.apply`` inside ``zero.Init``: as torch's (children first, then the module), with each
    module's partitioned parameters gathered around ``fn(module)`` and rank 0's values kept."""
    for child in module.children():
        child.apply(fn)
    own = [
        sp
        for sp in (lookup(p) for p in module._parameters.values() if p is not None)
        if sp is not None and sp.state is ParamState.SHARDED
    ]
    if not own:
        fn(module)
        return module
    with GatheredParameters([sp.param for sp in own], modifier_rank=0):
        fn(module)
    return module


def warn_lost_writes(sharded, where: str) -> None:
    """Say, on every rank, which partitioned parameters were written in place while released (the write was
    lost), and the way out. Costs one integer comparison per parameter."""
    lost = [sp.name for sp in sharded if sp.written_while_released]
    if lost:
        shown = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
        logger.warning(
            "%s: %d partitioned parameter(s) were written in place while partitioned, and the writes "
            "were lost (they show an empty tensor outside a gather): %s. Initialise them inside the "
            "module's constructor or its self.apply(...), or wrap the writes in "
            "zengine.zero.GatheredParameters(params, modifier_rank=0)",
            where,
            len(lost),
            shown,
        )
        for sp in sharded:  # said once
            if sp.param is not None:
                sp.freed_version = sp.param._version


def _standalone_fetcher(sp: ShardedParam) -> Fetcher:
    """A fetcher over the ranks ``sp`` was cut over (every rank, or its MiCS shard group)."""
    cfg = SimpleNamespace(
        stage3_prefetch_bucket_size=0,
        stage3_max_live_parameters=10**18,
        stage3_max_reuse_distance=0,
        stage3_debug_fetch_order=False,
        reduce_bucket_size=0,  # (no gradients go through it)
    )
    group = None if sp.world == dist.get_world_size() else mics_groups(sp.world)[0]
    return Fetcher(cfg, sp.world, sp.rank, sp.full.device, group)


@contextlib.contextmanager
def GatheredParameters(
    params,
    modifier_rank: Optional[int] = None,
    fwd_module: Optional[nn.Module] = None,
    enabled: bool = True,
):
    """Gather ``params`` (a parameter or an iterable of them) in full for the block; see the module doc.
    DeepSpeed's signature: ``fwd_module`` (whose forward uses parameters it does not own, which
    DeepSpeed then registers as external) is accepted and needs nothing here: zengine's stage-3 hooks
    gather a parameter wherever it is used."""
    if isinstance(params, torch.Tensor):
        params = [params]
    sharded = [sp for sp in (lookup(p) for p in params) if sp is not None]
    if not enabled or not sharded:
        yield
        return
    owner = sharded[0].owner
    with agreement.collective_call(
        "GatheredParameters", owner.comm_group if owner is not None else None
    ):
        if owner is not None:
            with owner.full_params(sharded, modifier_rank=modifier_rank):
                yield
            return
        fetcher = _standalone_fetcher(
            sharded[0]
        )  # parameters partitioned by Init, not yet in an engine
        todo = [sp for sp in sharded if sp.state is ParamState.SHARDED]
        fetcher.fetch(todo, "GatheredParameters")
        try:
            yield
        finally:
            if modifier_rank is not None:
                for sp in todo:
                    collectives.broadcast(sp.full, modifier_rank)
                    sp.write_back_full()
            for sp in todo:
                sp.free()
