"""Partial optimizer offload (``offload_optimizer.ratio`` below 1, stage 3, device ``cpu``).

DeepSpeed 0.19.8's meaning (``stage3.py``: ``subgroup_to_device``, ``backup_optimizer``): the
optimizer's sub-groups (each param group cut into runs of whole parameters of about
``sub_group_size`` shard elements, ``zero/sub_groups.py``) are numbered across the param groups;
sub-group ``i`` lives on the host and is stepped by CPU-Adam when ``i >= int((1 - ratio) * n)``,
else its fp32 master, gradient shard and Adam moments stay on the compute device, stepped there by
torch's Adam(W) with the same hyper-parameters. Stage 3 makes each sub-group a group of its own,
so every group has one home; ``PartialPlacement`` (an ``OptimizerHome``) answers for each
(``group_home``) with a ``DevicePlacement`` or a ``CPUPlacement`` and wraps the optimizer in
``ops/partial_adam.PartialAdam``, which steps each share where it lives. ``PartialCopies`` makes
the copies leave the device share alone: its parameters are written in place on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from ..ops.adam import CPUAdam
from ..ops.partial_adam import PartialAdam
from .copies import HostCopies
from .placement import CPUPlacement, DevicePlacement, OptimizerHome

if TYPE_CHECKING:
    from ..config.zero import OffloadOptimizerConfig


def host_share(count: int, ratio: float) -> list[bool]:
    """Per sub-group (in DeepSpeed's order), whether it lives on the host: DeepSpeed's rule, in its
    float arithmetic, so both engines cut the same sub-groups."""
    first_on_host = int((1 - ratio) * count)
    return [i >= first_on_host for i in range(count)]


class PartialOptimizerError(ValueError):
    """Partial offload was asked of an optimizer that cannot be split between host and device."""


class PartialCopies(HostCopies):
    """The host share's copies (``copies.make_copies``), with the device share's parameter targets
    left on the device: its optimizer writes them in place, nothing crosses. Gradient pieces need
    no choice here: a shard on the device takes its pieces in place in every ``HostCopies``."""

    def __init__(self, host: HostCopies, on_device: Sequence[bool]):
        self.host = host
        self.on_device = list(on_device)  # per group
        self.pins, self.defers = host.pins, host.defers

    def copy_out_target(self, gi: int, owned: torch.Tensor) -> torch.Tensor:
        return owned if self.on_device[gi] else self.host.copy_out_target(gi, owned)

    def writable(self, gi: int, owned: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return owned if self.on_device[gi] else self.host.writable(gi, owned, lo, hi)

    def send_piece(self, gi: int, lo: int, hi: int) -> None:
        if not self.on_device[gi]:
            self.host.send_piece(gi, lo, hi)

    # -- the rest is the host share's ---------------------------------------------------------------
    def accumulate(self, shard_slice, piece, overwrite: bool = False) -> None:
        self.host.accumulate(shard_slice, piece, overwrite)

    def accumulate_async(self, shard_slice, piece, overwrite: bool = False) -> None:
        self.host.accumulate_async(shard_slice, piece, overwrite)

    def settle(self) -> None:
        self.host.settle()

    def settle_range(self, view: torch.Tensor) -> None:
        self.host.settle_range(view)

    def arrival(self, view: torch.Tensor) -> int:
        return self.host.arrival(view)

    def reuse_marker(self):
        return self.host.reuse_marker()

    def before_reuse(self, marker) -> None:
        self.host.before_reuse(marker)

    def download(self, dst: torch.Tensor, src: torch.Tensor):
        return self.host.download(dst, src)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.host.upload(dst, src)

    def before_step(self) -> None:
        self.host.before_step()

    def after_step(self) -> None:
        self.host.after_step()

    def pieces_sent(self) -> None:
        self.host.pieces_sent()


class PartialPlacement(DevicePlacement):
    """The optimizer's sub-groups split between the compute device and host memory (module doc).
    Group-wide questions (``empty``, ``master_device``) are the host share's; per group, ask
    ``group_home``."""

    cpu_optimizer = True  # gradient shards are fp32 in both shares (DeepSpeed's), CPU-Adam is built

    def __init__(
        self,
        offload_cfg: OffloadOptimizerConfig,
        device: torch.device,
        sub_group_size: int,
        groups: int,
    ):
        self.host = CPUPlacement(offload_cfg, device, sub_group_size)
        self.device_home = DevicePlacement()
        self.ratio = float(offload_cfg.ratio)
        self.on_host = host_share(groups, self.ratio)  # per group (= sub-group)
        self.piece, self.pin = self.host.piece, self.host.pin
        self.copies = PartialCopies(self.host.copies, [not h for h in self.on_host])

    def group_home(self, gi: int) -> OptimizerHome:
        return self.host if self.on_host[gi] else self.device_home

    def master_device(self, device: torch.device) -> torch.device:
        return self.host.master_device(device)

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.host.empty(numel, dtype, device)

    def make_master(self, owned: torch.Tensor) -> torch.Tensor:
        return self.host.make_master(owned)

    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, shard_params: Sequence[torch.Tensor] = ()
    ) -> torch.optim.Optimizer:
        """CPU-Adam over the host share, torch's Adam(W) over the device share (``PartialAdam``,
        sharing the optimizer's param groups so that a schedule set on either reaches both). The
        optimizer must be an Adam: DeepSpeed takes only its CPU-Adam here ("Hybrid Optimizer Only
        Supports DeepSpeedCPUAdam"); zengine also takes torch's Adam and AdamW, which the config's
        Adam becomes when some shards are on the device (``optim/builder.py``)."""
        if not isinstance(optimizer, (CPUAdam, torch.optim.Adam)):
            raise PartialOptimizerError(
                f"zero_optimization.offload_optimizer.ratio {self.ratio:g}: partial offload steps the "
                f"host share with CPU-Adam and the device share with torch's Adam(W), so the optimizer "
                f"must be Adam, AdamW or CPUAdam (the config's optimizer section, torch.optim.Adam "
                f"or AdamW, or zengine.ops.DeepSpeedCPUAdam); got {type(optimizer).__name__}. Use "
                f"one of those, or leave ratio at 1.0"
            )
        on_device = [p for p, host in zip(shard_params, self.on_host) if not host]
        return PartialAdam.replacing(optimizer, on_device)
