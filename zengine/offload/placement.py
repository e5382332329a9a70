"""Where a run's model states live, decided once from the config: the ``Placement``.

Two homes make a placement:

- ``optimizer`` (``offload_optimizer.device``): where the fp32 master shard, its gradient and the
  optimizer states live. ``DevicePlacement`` keeps them on the compute device; ``CPUPlacement``
  in CPU memory (pinned with ``pin_memory`` on a GPU machine), so that each reduced gradient
  bucket is copied straight into the CPU shard during backward and the step runs on the CPU
  with the compiled CPUAdam; ``NVMePlacement`` as CPU, with Adam's moments in a swap file
  (``swapped_adam.py``); ``InfinityPlacement`` (NVMe at stage 3, ZeRO-Infinity) swaps the
  masters and their gradients with the moments. Each builds the master store that goes with it
  (``master_store``: ``masters.MastersInMemory``, or ZeRO-Infinity's ``infinity.SwappedMasters``
  with its gradient sink).
- ``params`` (``offload_param.device``, stage 3): where the compute-dtype parameter shards live.
  ``ParamsInMemory`` on the compute device, or in host memory with ``cpu``; ``ParamsOnNVMe`` in
  a swap file (``param_swap.py``).

The stage optimizers never ask which placement they have: they call its methods, and its
``copies`` (``copies.py``) move data between the compute device and where the shards live.
``make_placement`` is the one place that reads the offload sections. ``OptimizerHome`` and
``ParamsHome`` name the two roles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import torch

from ..ops.aio import AsyncIO
from ..precision.masters import MasterPrecision
from . import pinned
from .copies import HostCopies, host_pinning, make_copies
from .infinity import SwappedMasters, record_dtypes
from .masters import MastersInMemory
from .param_swap import ParamSwap, align_elems, round_up
from .state_swap import FP32_PARTS, StateSwapper, block_elems, chunk_elements
from .step_pipeline import piece_elements
from .swapped_adam import SwappedAdam

if TYPE_CHECKING:  # annotations only; offload/ never imports zero/ at run time
    from ..config.zero import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
    from ..zero.flat_group import ParamGroup
    from ..zero.masters import MasterStore

WRITE_CHUNK = 1 << 24  # elements per write when NVMe shards are refreshed from masters in memory
FP32_MASTERS = MasterPrecision()  # the default: fp32 masters and moments


class OptimizerHome(Protocol):
    """Where the fp32 masters, their gradients and the optimizer states live, and what goes with it:
    the copies to and from the compute device and the master store."""

    cpu_optimizer: bool  # the optimizer built for the shards is the CPU one (CPUAdam)
    master_dtype: torch.dtype  # fp32, or bf16 (bf16_master_weights_and_grads)
    piece: int  # elements per piece of an offloaded step taken in pieces (step_pipeline.py)
    copies: HostCopies
    copies_out: bool  # the step may write the compute-dtype parameters as it updates the masters

    def master_device(self, device: torch.device) -> torch.device: ...

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, shard_params: Sequence[torch.Tensor] = ()
    ) -> torch.optim.Optimizer: ...

    def group_home(self, gi: int) -> "OptimizerHome": ...

    def make_master(self, owned: torch.Tensor) -> torch.Tensor: ...

    def shard_alignment(self, dtype: torch.dtype) -> int: ...

    def shard_dtype(self, compute: torch.dtype) -> torch.dtype: ...

    def master_store(
        self,
        groups: list,
        params: "ParamsHome",
        dtype: torch.dtype,
        world: int,
        device: torch.device,
    ) -> "MasterStore": ...

    def close(self) -> None: ...


class ParamsHome(Protocol):
    """Where the compute-dtype parameter shards live (stage 3; stages 0-2: in memory, whole)."""

    swap: Optional[ParamSwap]  # the parameter swap file, if any
    shard_device: torch.device
    pin: bool
    copies_out: bool  # the optimizer may write the parameters while stepping (CPUAdam's copy-out)

    def alignment(self, dtype: torch.dtype, optimizer_alignment: int) -> int: ...

    def shard_dtype(self, optimizer: OptimizerHome, compute: torch.dtype) -> torch.dtype: ...

    def master(self, group: "ParamGroup", optimizer: OptimizerHome) -> torch.Tensor: ...

    def write_params(self, group: "ParamGroup", master: torch.Tensor, copied: bool) -> None: ...

    def write_param(self, group: "ParamGroup", pi: int, master: torch.Tensor) -> None: ...

    def piece_size(self, size: int) -> int: ...

    def piece_stepped(
        self, group: "ParamGroup", lo: int, hi: int, master: torch.Tensor
    ) -> None: ...

    def load(self, group: "ParamGroup", master: torch.Tensor) -> None: ...

    def host_buffers(self) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


class DevicePlacement:
    """Masters and optimizer states on the compute device."""

    cpu_optimizer = False  # the optimizer built for the shards is the CPU one (CPUAdam)
    piece = piece_elements(
        1_000_000_000
    )  # elements per piece of an offloaded step taken in pieces (step_pipeline.py)
    copies_out = True  # the step may write the parameters as it updates the masters in memory

    def __init__(self, master_dtype: torch.dtype = torch.float32):
        self.copies = HostCopies()  # shards live with the parameters: nothing crosses
        self.master_dtype = master_dtype  # bf16 with bf16_master_weights_and_grads

    def master_device(self, device: torch.device) -> torch.device:
        return device

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer for master-side state (masters, master gradients)."""
        return torch.zeros(numel, dtype=dtype, device=self.master_device(device))

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, shard_params: Sequence[torch.Tensor] = ()
    ) -> torch.optim.Optimizer:
        """The optimizer that steps the master shards (``shard_params``, one per group: NVMe offload
        swaps its states, partial offload steps each share where it lives)."""
        return optimizer

    def group_home(self, gi: int) -> "OptimizerHome":
        """The home of group ``gi``'s master, gradient shard and states: this one for every group
        (partial offload answers per group: ``partial.PartialPlacement``)."""
        return self

    def make_master(self, owned: torch.Tensor) -> torch.Tensor:
        """The master of a rank's owned parameter slice, in ``master_dtype``: parameters of that
        dtype on the master's device are shared (fp32 parameters; bf16 ones with bf16 masters),
        so the master costs no memory of its own."""
        if owned.dtype == self.master_dtype and owned.device == self.master_device(owned.device):
            return owned
        master = self.empty(owned.numel(), self.master_dtype, owned.device)
        master.copy_(owned)
        return master

    def shard_alignment(self, dtype: torch.dtype) -> int:
        """Elements each stage-3 parameter shard must be aligned to for the masters' sake."""
        return 1

    def shard_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype of stage-3 parameter shards on the compute device whose masters this home keeps
        there: the masters' own, so that one tensor is both (``make_master`` shares it), as FSDP2's
        sharded fp32 parameters are; the gathers cast each row to ``compute``. A compute-dtype shard
        beside an fp32 master would cost 2 bytes a parameter more over the ranks (the 1.3B GPT's
        device memory above FSDP2's, issue 43)."""
        return self.master_dtype

    def master_store(
        self,
        groups: list,
        params: "ParamsHome",
        dtype: torch.dtype,
        world: int,
        device: torch.device,
    ) -> "MasterStore":
        """The store of ``groups``' fp32 masters (computed in ``dtype`` on ``device``, sharded over
        ``world`` ranks): tensors where this home keeps them."""
        return MastersInMemory(groups, self, params, world, device)

    def close(self) -> None:
        """Release what the placement holds (files, I/O threads) beyond the optimizer's."""


class CPUPlacement(DevicePlacement):
    """Masters, master gradients and optimizer states in (pinned) CPU memory."""

    cpu_optimizer = True

    def __init__(
        self,
        offload_cfg: OffloadOptimizerConfig,
        device: torch.device,
        sub_group_size: int = 1_000_000_000,
        master_dtype: torch.dtype = torch.float32,
    ):
        self.master_dtype = master_dtype
        self.pin = bool(offload_cfg.pin_memory) and host_pinning(
            device
        )  # pinned only to copy to a GPU
        self.copies = make_copies(device)
        self.piece = piece_elements(sub_group_size)

    def master_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def shard_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The masters are in host memory: the device's shards stay in the compute dtype."""
        return compute

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return pinned.zeros(
            numel, dtype, kind=pinned.OPTIMIZER, pin=self.pin
        )  # pinned sized exactly


class NVMePlacement(CPUPlacement):
    """As ``CPUPlacement``, with Adam's moments swapped to a file under ``nvme_path`` (``swapped_adam.py``),
    in ``precision.states`` (fp32, or bf16 with ``bf16_optimizer_states``)."""

    def __init__(
        self,
        zero_cfg: ZeroConfig,
        device: torch.device,
        aio_cfg: Optional[AioConfig] = None,
        precision: MasterPrecision = FP32_MASTERS,
    ):
        offload_cfg = zero_cfg.offload_optimizer
        super().__init__(offload_cfg, device, zero_cfg.sub_group_size, precision.dtype)
        self.precision = precision
        self.directory = str(offload_cfg.nvme_path)
        self.chunk = int(zero_cfg.sub_group_size)
        self.buffer_count = int(offload_cfg.buffer_count)
        self.aio_cfg = aio_cfg
        # the step's pieces are SwappedAdam's chunks: stage 1 copies its gradient down in those too
        self.piece = chunk_elements(self.chunk, block_elems(self.record_dtypes()))

    def record_dtypes(self) -> tuple:
        """The parts of each chunk's record in the swap file: the moments (ZeRO-Infinity adds more)."""
        return (self.precision.states,) * 2

    def swapper(
        self, numels: list[int], dtypes: Sequence[torch.dtype] = FP32_PARTS, align: int = 1
    ) -> StateSwapper:
        """A swap file with a run per entry of ``dtypes`` per chunk of each of ``numels``, and its host
        buffers."""
        return StateSwapper(
            numels,
            self.directory,
            self.chunk,
            self.buffer_count,
            make_aio(self.aio_cfg),
            self.pin,
            dtypes,
            align,
        )

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, shard_params: Sequence[torch.Tensor] = ()
    ) -> torch.optim.Optimizer:
        numels = [p.numel() for g in optimizer.param_groups for p in g["params"]]
        return SwappedAdam.replacing(optimizer, self.swapper(numels, self.record_dtypes()))


class InfinityPlacement(NVMePlacement):
    """ZeRO-Infinity (optimizer on NVMe at stage 3): the masters and their gradients are swapped with the
    moments, so host memory for the optimizer is the swap buffers. It builds its parts
    (``infinity.py``): the master store ``SwappedMasters`` and, in it, the gradient sink
    ``GradSwap``."""

    copies_out = False  # the swapped step writes each updated chunk into the parameters itself

    def record_dtypes(self) -> tuple:
        """``[exp_avg | exp_avg_sq | master | (Kahan's compensation) | grad]`` (``infinity.py``)."""
        p = self.precision
        return record_dtypes(p.dtype, p.states, bool(p.rounding.buffers))

    def shard_alignment(self, dtype: torch.dtype) -> int:
        return align_elems(dtype)  # the masters' records are read by chunks aligned as the shards

    def master_store(
        self,
        groups: list,
        params: "ParamsHome",
        dtype: torch.dtype,
        world: int,
        device: torch.device,
    ) -> "MasterStore":
        return SwappedMasters(groups, dtype, self)


class ParamsInMemory:
    """Stage-3 parameter shards in memory: on the compute device, or in host memory with
    ``offload_param.device = "cpu"`` (pinned with ``pin_memory`` on a GPU machine, for the copies up).
    Stages 0-2 keep every parameter whole on the device: this home too."""

    swap = None  # no swap file

    def __init__(self, offload_cfg: Optional[OffloadParamConfig], device: torch.device):
        offload = offload_cfg is not None and offload_cfg.device in ("cpu", "nvme")
        self.device = device  # the compute device
        self.shard_device = (
            torch.device("cpu") if offload else device
        )  # host memory by design with offload
        self.pin = offload and bool(offload_cfg.pin_memory) and host_pinning(device)
        self.offloaded = offload

    def shard_dtype(self, optimizer: OptimizerHome, compute: torch.dtype) -> torch.dtype:
        """A trained group's shard dtype: the masters' where ``optimizer`` (the group's home) keeps
        them on the device with the shards, else the compute dtype (offloaded shards are uploaded
        to be gathered, in the dtype they are computed in)."""
        return compute if self.offloaded else optimizer.shard_dtype(compute)

    def alignment(self, dtype: torch.dtype, optimizer_alignment: int) -> int:
        """Elements each parameter's shard is aligned to: swap files need O_DIRECT-aligned offsets
        (``optimizer_alignment``: the optimizer home's, for swapped masters)."""
        return optimizer_alignment

    def master(self, group, optimizer: OptimizerHome) -> torch.Tensor:
        """A group's fp32 master, in memory where ``optimizer`` keeps masters."""
        return optimizer.make_master(group.owned_params())

    copies_out = True  # the optimizer may write the parameters while stepping (CPUAdam's copy-out)

    def write_params(self, group, master: torch.Tensor, copied: bool) -> None:
        """After the step: the compute-dtype shard from the fp32 ``master`` (unless ``copied`` already)."""
        owned = group.owned_params()
        if not copied and owned.data_ptr() != master.data_ptr():
            owned.copy_(master)

    def write_param(self, group, pi: int, master: torch.Tensor) -> None:
        """After ``safe_set_full_fp32_param`` set parameter ``pi``'s part of ``master``: nothing more to
        write (the caller copied it into the shard)."""

    def piece_size(self, size: int) -> int:
        """Elements per piece of a step taken in pieces, from the optimizer home's ``size``."""
        return size

    def piece_stepped(self, group, lo: int, hi: int, master: torch.Tensor) -> None:
        """A step in pieces updated ``master[lo:hi]``: nothing to do (the optimizer wrote the shard,
        or it is written after the step)."""

    def load(self, group, master: torch.Tensor) -> None:
        """The fp32 ``master`` from the compute-dtype shard (after the shard was written)."""
        if master.data_ptr() != group.owned_params().data_ptr():
            master.copy_(group.owned_params())

    def host_buffers(self) -> list[torch.Tensor]:
        return []

    def close(self) -> None:
        pass


class ParamsOnNVMe(ParamsInMemory):
    """Stage-3 parameter shards in one swap file per rank (``param_swap.ParamSwap``), read ahead of the
    gathers through a bounded pool of host buffers; written from the masters after each step."""

    copies_out = False  # the shards are written to the file after the step

    def __init__(
        self,
        offload_cfg: OffloadParamConfig,
        device: torch.device,
        dtype: torch.dtype,
        aio_cfg: Optional[AioConfig],
        sizes: list[int],
    ):
        super().__init__(offload_cfg, device)
        self.swap = ParamSwap(offload_cfg, dtype, make_aio(aio_cfg), device, sizes)
        self._written: set[int] = (
            set()
        )  # groups whose pieces a step in pieces wrote (piece_stepped)

    def alignment(self, dtype: torch.dtype, optimizer_alignment: int) -> int:
        return align_elems(dtype)

    def master(self, group, optimizer: OptimizerHome) -> torch.Tensor:
        master = optimizer.empty(group.shard_numel, optimizer.master_dtype, self.device)
        group.read_into(master, WRITE_CHUNK)
        return master

    def write_params(self, group, master: torch.Tensor, copied: bool) -> None:
        if id(group) in self._written:  # the step in pieces wrote each piece behind: they land
            self._written.discard(id(group))
            group.swap.flush()
            return
        group.write_from(master, WRITE_CHUNK)

    def piece_size(self, size: int) -> int:
        """Whole O_DIRECT blocks, so that each piece is written on its own."""
        return round_up(size, self.swap.align)

    def piece_stepped(self, group, lo: int, hi: int, master: torch.Tensor) -> None:
        """The piece's parameters go to the swap file behind, while the next piece is stepped (the
        pieces cover the shard, so ``write_params`` then only waits for them)."""
        group.swap.write_range(group.base, lo, hi, master[lo:hi], group.resident())
        self._written.add(id(group))

    def write_param(self, group, pi: int, master: torch.Tensor) -> None:
        sp, off = group.sharded[pi], group.offsets[pi]
        sp.swap_file.write_shard(sp, master[off : off + sp.chunk])

    def load(self, group, master: torch.Tensor) -> None:
        group.read_into(master, WRITE_CHUNK)

    def host_buffers(self) -> list[torch.Tensor]:
        return self.swap.host_buffers()

    def close(self) -> None:
        self.swap.close()


@dataclass(frozen=True)
class Placement:
    """Where one run's model states live (see the module docstring)."""

    optimizer: OptimizerHome  # masters, their gradients, optimizer states
    params: ParamsHome  # compute-dtype parameters (stage-3 shards)

    @property
    def copies_out(self) -> bool:
        """Whether the step may write the compute-dtype parameters as it updates the masters."""
        return self.params.copies_out and self.optimizer.copies_out

    def alignment(self, dtype: torch.dtype) -> int:
        """Elements each stage-3 parameter's shard is aligned to."""
        return self.params.alignment(dtype, self.optimizer.shard_alignment(dtype))

    def shard_dtype(self, gi: int, compute: torch.dtype) -> torch.dtype:
        """The dtype stage-3 group ``gi`` keeps its parameter shard in (``ParamsInMemory.shard_dtype``)."""
        return self.params.shard_dtype(self.optimizer.group_home(gi), compute)

    def master_store(
        self, groups: list, dtype: torch.dtype, world: int, device: torch.device
    ) -> "MasterStore":
        """The store of ``groups``' fp32 masters, as the optimizer home keeps them."""
        return self.optimizer.master_store(groups, self.params, dtype, world, device)

    def close(self) -> None:
        self.params.close()
        self.optimizer.close()


def make_aio(aio_cfg: Optional[AioConfig]) -> AsyncIO:
    """An ``AsyncIO`` pool as the config's ``aio`` section asks (its defaults without one)."""
    if aio_cfg is None:
        return AsyncIO()
    return AsyncIO(aio_cfg.block_size, aio_cfg.thread_count, aio_cfg.queue_depth)


def optimizer_placement(
    zero_cfg: ZeroConfig,
    device: torch.device,
    aio_cfg: Optional[AioConfig] = None,
    groups: int = 0,
    precision: MasterPrecision = FP32_MASTERS,
) -> OptimizerHome:
    """Where ``zero_cfg.offload_optimizer`` puts the masters and optimizer states (of ``precision``:
    fp32, or bf16 masters and states) (``groups``: how many groups the optimizer steps, which partial
    offload splits between device and host)."""
    master_dtype = precision.dtype
    offload_cfg = zero_cfg.offload_optimizer
    target = getattr(offload_cfg, "device", "none") if offload_cfg is not None else "none"
    if target == "cpu" and offload_cfg.partial:  # (stage 3: the config refuses it below)
        if master_dtype != torch.float32:
            raise ValueError(
                "zero_optimization.offload_optimizer.ratio with "
                f"{precision.section}.{precision.section}_master_weights_and_grads: partial "
                "offload steps fp32 masters only; "
                "offload every optimizer state (ratio 1.0) or keep fp32 masters"
            )
        from .partial import PartialPlacement  # (it builds on this module)

        return PartialPlacement(offload_cfg, device, zero_cfg.sub_group_size, groups)
    if target == "cpu":
        return CPUPlacement(offload_cfg, device, zero_cfg.sub_group_size, master_dtype)
    if target == "nvme":
        return (InfinityPlacement if zero_cfg.stage == 3 else NVMePlacement)(
            zero_cfg, device, aio_cfg, precision
        )
    return DevicePlacement(master_dtype)


def make_placement(
    zero_cfg: ZeroConfig,
    device: torch.device,
    dtype: torch.dtype,
    aio_cfg: Optional[AioConfig] = None,
    chunks: list[list[int]] = (),
    precision: MasterPrecision = FP32_MASTERS,
) -> Placement:
    """The placement the config's offload sections ask for, for parameters computed on ``device`` in
    ``dtype``. ``chunks``: at stage 3, each param group's shard sizes (elements per parameter), which
    size the parameter swap file. ``precision``: fp32 masters, or bf16 masters and states."""
    optimizer = optimizer_placement(zero_cfg, device, aio_cfg, len(chunks), precision)
    offload_param = zero_cfg.offload_param if zero_cfg.stage == 3 else None
    if offload_param is not None and offload_param.device == "nvme":
        align = align_elems(dtype)  # as the groups lay their shards out
        sizes = [sum(round_up(n, align) for n in group) + align for group in chunks]
        return Placement(optimizer, ParamsOnNVMe(offload_param, device, dtype, aio_cfg, sizes))
    return Placement(optimizer, ParamsInMemory(offload_param, device))
