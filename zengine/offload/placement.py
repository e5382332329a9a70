"""Where the fp32 master shard, its gradient and the optimizer states live.

``DevicePlacement`` keeps them on the compute device. ``CPUPlacement``
(``offload_optimizer.device = "cpu"``) keeps them in CPU memory, pinned when
``pin_memory`` is set and a GPU is present, so that stage 2 can copy each
reduced gradient bucket straight into the CPU shard during backward and the
step runs on the CPU with the compiled CPUAdam; the updated parameters go
back to the device in the compute dtype.

The rest of the engine never asks which placement it has: it asks the
placement for tensors, and for its ``copies`` (``copies.py``) to move data
between the compute device and where the shards live.
"""
from __future__ import annotations

import torch

from .copies import HostCopies, make_copies


class DevicePlacement:
    """Masters and optimizer states on the compute device."""

    cpu_optimizer = False

    def __init__(self):
        self.copies = HostCopies()  # shards live with the parameters: nothing crosses

    def master_device(self, device: torch.device) -> torch.device:
        return device

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer for master-side state (masters, master gradients)."""
        return torch.zeros(numel, dtype=dtype, device=self.master_device(device))

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer that steps the master shards (NVMe offload swaps its states)."""
        return optimizer

    def make_master(self, owned: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a rank's owned parameter slice; fp32 parameters on the same device are shared."""
        if owned.dtype == torch.float32 and owned.device == self.master_device(owned.device):
            return owned
        master = self.empty(owned.numel(), torch.float32, owned.device)
        master.copy_(owned)
        return master


class CPUPlacement(DevicePlacement):
    """Masters, master gradients and optimizer states in (pinned) CPU memory."""

    cpu_optimizer = True

    def __init__(self, offload_cfg, device: torch.device):
        self.pin = bool(offload_cfg.pin_memory) and device.type == "cuda"  # pinned only to copy to a GPU
        self.copies = make_copies(device)

    def master_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin)


class NVMePlacement(CPUPlacement):
    """As ``CPUPlacement``, with Adam's moments swapped to a file under ``nvme_path`` (``state_swap.py``)."""

    def __init__(self, zero_cfg, device: torch.device, aio_cfg=None):
        offload_cfg = zero_cfg.offload_optimizer
        super().__init__(offload_cfg, device)
        self.directory = str(offload_cfg.nvme_path)
        self.chunk = int(zero_cfg.sub_group_size)
        self.buffer_count = int(offload_cfg.buffer_count)
        self.aio_cfg = aio_cfg
        self.infinity = None  # stage 3 sets a MasterIO: the masters and gradients are swapped too

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from .state_swap import StateSwapper, SwappedAdam

        def swapper_for(numels, parts=2, align=1024):
            return StateSwapper(numels, self.directory, self.chunk, self.buffer_count, make_aio(self.aio_cfg),
                                self.pin, parts, align)

        return SwappedAdam.replacing(optimizer, swapper_for, self.infinity)


def make_aio(aio_cfg):
    """An ``AsyncIO`` pool as the config's ``aio`` section asks (its defaults without one)."""
    from ..ops.aio import AsyncIO

    if aio_cfg is None:
        return AsyncIO()
    return AsyncIO(aio_cfg.block_size, aio_cfg.thread_count, aio_cfg.queue_depth)


def make_placement(zero_cfg, device: torch.device, aio_cfg=None) -> DevicePlacement:
    """The placement that ``zero_cfg.offload_optimizer`` asks for, for parameters computed on ``device``."""
    offload_cfg = zero_cfg.offload_optimizer
    target = getattr(offload_cfg, "device", "none") if offload_cfg is not None else "none"
    if target == "cpu":
        return CPUPlacement(offload_cfg, device)
    if target == "nvme":
        return NVMePlacement(zero_cfg, device, aio_cfg)
    return DevicePlacement()
