"""The engine members DeepSpeed scripts call beyond training itself: rank and config accessors,
manual accumulation control, optimizer queries and moving the model states off the device between
phases (the checkpoint members are saving.py's).

``Engine`` takes these by inheritance (``class Engine(DeepSpeedMembers, nn.Module)``) so that
engine.py keeps to training; each member reads the engine's config, process rank and optimizer.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from ..distributed import traffic
from ..log import setup_logging
from ..offload import pinned
from ..precision.grad_factor import GradFactor
from .accumulation import Accumulation

if TYPE_CHECKING:
    from ..config import ZengineConfig
    from ..distributed.process_group import ProcessRank
    from ..zero.optimizer import ZeroOptimizer


class OffloadStateTypeEnum(str, enum.Enum):
    """What ``offload_states`` moves (DeepSpeed's names)."""

    optim_states = "optim_states"  # the optimizer's moments
    hp_params = "hp_params"  # fp32 master weights
    lp_params = "lp_params"  # the compute-dtype parameters
    lp_grads = "lp_grads"  # gradients (buffers or shards)
    contiguous_grad_buffer = "contiguous_grad_buffer"  # the same buffers as lp_grads here


class OffloadDeviceEnum(str, enum.Enum):
    """Where ``offload_states`` moves them (DeepSpeed's names; zengine offers the CPU)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


_logger = setup_logging()
_KINDS = {
    "optim_states": "optimizer_states",
    "hp_params": "master_weights",
    "lp_params": "parameters",
    "lp_grads": "gradients",
    "contiguous_grad_buffer": "gradients",
}


class DeepSpeedMembers:
    """Members of DeepSpeed's engine that scripts call (docs/API.md lists them).

    A mix-in of ``Engine``: it reads only these of the engine's members, all public.
    """

    config: "ZengineConfig"
    optimizer: "ZeroOptimizer"
    grad_factor: GradFactor
    accumulation: Accumulation
    held_states: list
    pinned_spares: list
    process_rank: "ProcessRank"
    scaler: Any
    _step_applied: bool
    micro_steps: int
    global_steps: int

    # -- config accessors -------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        """The global batch: micro batch x accumulation steps x world size."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per micro-step."""
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        """Whether the config turns on fp16 mixed precision."""
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        """Whether the config turns on bf16 mixed precision."""
        return bool(self.config.bf16.enabled)

    bf16_enabled = bfloat16_enabled

    def gradient_clipping(self) -> float:
        """The global-norm clipping threshold (0: off)."""
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int:
        """Optimizer steps between progress reports."""
        return int(self.config.steps_per_print)

    def wall_clock_breakdown(self) -> bool:
        """Whether forward/backward/step are timed and reported."""
        return bool(self.config.wall_clock_breakdown)

    def zero_offload_optimizer(self) -> bool:
        """Whether optimizer states live on the host (CPU or NVMe)."""
        return self.config.offload_optimizer_enabled

    def zero_offload_param(self) -> bool:
        """Whether stage-3 parameter shards live on the host."""
        return self.config.offload_param_enabled

    def zero_reduce_bucket_size(self) -> int:
        """Elements per gradient bucket."""
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        """Elements per parameter all-gather bucket."""
        return int(self.config.zero_optimization.allgather_bucket_size)

    def zero_overlap_comm(self) -> bool:
        """Whether gradient reductions overlap backward."""
        return bool(self.config.zero_optimization.overlap_comm)

    def get_data_parallel_world_size(self) -> int:
        """Ranks sharing the data-parallel work (the world size: no model parallelism)."""
        return self.world_size

    def get_data_parallel_rank(self) -> int:
        """This rank among them."""
        return self.global_rank

    # -- rank and step accessors --------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.process_rank.rank

    @property
    def local_rank(self) -> int:
        return self.process_rank.local_rank

    @property
    def world_size(self) -> int:
        return self.process_rank.world_size

    @property
    def device(self) -> torch.device:
        return self.process_rank.device

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` completes a global batch (or as set_gradient_accumulation_boundary said)."""
        return self.accumulation.is_boundary(self.micro_steps, self.gradient_accumulation_steps())

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """Norm of the whole unscaled gradient before clipping, at the last boundary."""
        return self.optimizer.global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def dp_world_size(self) -> int:
        """The data-parallel world size."""
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        """The model-parallel world size: 1."""
        return 1  # no model parallelism

    def optimizer_name(self) -> Optional[str]:
        """The config's optimizer type, or None when the script passed its own."""
        return self.config.optimizer.type if self.config.optimizer is not None else None

    def scheduler_name(self) -> Optional[str]:
        """The config's scheduler type, or None."""
        return self.config.scheduler.type if self.config.scheduler is not None else None

    # -- accumulation control ---------------------------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether ``step()`` ends a global batch, overriding the count of micro-steps (for loops whose
        number of micro-steps varies), until it is called again (``None`` returns to counting), as in
        DeepSpeed. Every rank must say the same."""
        self.accumulation.boundary_override = None if is_boundary is None else bool(is_boundary)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (micro batch and world size
        stay). Only between global batches; the new size must be a multiple of micro batch x world."""
        per_step = self.train_micro_batch_size_per_gpu() * self.world_size
        if train_batch_size % per_step != 0:
            raise ValueError(
                f"set_train_batch_size({train_batch_size}): not a multiple of micro batch "
                f"{self.train_micro_batch_size_per_gpu()} x world size {self.world_size} = {per_step}"
            )
        if not self.accumulation.between_batches:
            raise RuntimeError(
                "set_train_batch_size: call it between global batches (after the boundary "
                "step), not in the middle of gradient accumulation"
            )
        gas = train_batch_size // per_step
        self.config.train_batch_size = train_batch_size
        self.config.gradient_accumulation_steps = gas
        self.grad_factor.accumulation_steps = gas  # what the losses or the next step divide by
        self.accumulation.start_window(
            self.micro_steps
        )  # the next micro-step begins a global batch

    # -- optimizer queries ------------------------------------------------------------------------
    def get_mom(self) -> list:
        """Each param group's momentum: ``betas`` (Adam family) or ``momentum`` (SGD)."""
        out = []
        for group in self.optimizer.param_groups:
            out.append(group["betas"] if "betas" in group else group.get("momentum"))
        return out

    def get_pld_theta(self):
        """Progressive layer drop's theta: None (not a zengine feature)."""
        return None  # no progressive layer drop

    # -- moving the model states off the device between phases ----------------------------------
    def offload_states(
        self,
        include: Optional[Iterable] = None,
        device: str = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the model states (``include``: OffloadStateTypeEnum members or their names; default all)
        to host memory, freeing the device until ``reload_states()``. Views into them (the parameters)
        keep pointing at the same storage, which is emptied on the device and refilled on reload. Does
        nothing where the states already live on the host (CPU training, offloaded optimizer)."""
        if str(getattr(device, "value", device)) != "cpu":
            raise ValueError(f"offload_states(device={device!r}): zengine offloads to 'cpu' only")
        kinds = self.optimizer.memory_tensors()
        wanted = (
            [OffloadStateTypeEnum(getattr(k, "value", k)).value for k in include]
            if include
            else list(_KINDS)
        )
        moved = self.held_states
        seen = {s.data_ptr() for s, _ in moved}
        for name in wanted:
            for t in kinds[_KINDS[name]]:
                storage = t.untyped_storage()
                if t.device.type == "cpu" or storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                host = self._offload_host(storage.nbytes(), pin_memory)  # [bytes]
                host.untyped_storage().copy_(storage, non_blocking=non_blocking)
                moved.append((storage, host))
        if moved and non_blocking:
            from ..device import get_accelerator

            get_accelerator().synchronize()  # the copies must land before the device storage is freed
        for storage, _ in moved:
            storage.resize_(0)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what ``offload_states`` moved, into the same storage (views stay valid). Pinned host
        copies are kept for the next ``offload_states`` (pinned once, as DeepSpeed keeps its pinned buffers)."""
        for storage, host in self.held_states:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=non_blocking)
            if (
                host.is_pinned()
            ):  # (a later offload's copy into it is queued after this one on the stream)
                self.pinned_spares.append(host)
        self.held_states.clear()

    def _offload_host(self, nbytes: int, pin: bool) -> torch.Tensor:
        """[nbytes] uint8 host memory for one offloaded storage: a kept pinned one of that size, or new
        (pinned sized exactly: ``offload/pinned.py``)."""
        if pin:
            for i, host in enumerate(self.pinned_spares):
                if host.numel() == nbytes:
                    return self.pinned_spares.pop(i)
        return pinned.empty(nbytes, torch.uint8, kind=pinned.OFFLOADED_STATES, pin=pin)

    # -- saving ---------------------------------------------------------------------------------
    def comm_stats(self, reset: bool = False) -> dict:
        """What this process's engine collectives moved since the last reset: ``{"intra"|"inter": {collective:
        {"calls", "bytes", "ring_bytes"}}}`` (payload bytes, and bytes this rank sends on a ring), by whether
        the group stays on one node (``LOCAL_WORLD_SIZE`` ranks per node). See distributed/traffic.py."""
        return traffic.snapshot(reset)
