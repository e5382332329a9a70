"""Where the fp32 master shard, its gradient and the optimizer states live.

``DevicePlacement`` keeps them on the compute device. ``CPUPlacement``
(``offload_optimizer.device = "cpu"``) keeps them in CPU memory, pinned when
``pin_memory`` is set and a GPU is present, so that stage 2 can copy each
reduced gradient bucket straight into the CPU shard during backward and the
step runs on the CPU with the compiled CPUAdam; the updated parameters go
back to the device in the compute dtype.

The rest of the engine never asks which placement it has: it asks the
placement for tensors, and cross-device copies follow from where they live.
"""
from __future__ import annotations

import torch


class DevicePlacement:
    """Masters and optimizer states on the compute device."""

    cpu_optimizer = False

    def master_device(self, device: torch.device) -> torch.device:
        return device

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer for master-side state (masters, master gradients)."""
        return torch.zeros(numel, dtype=dtype, device=self.master_device(device))

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

    def __init__(self, offload_cfg):
        self.pin = bool(offload_cfg.pin_memory) and torch.cuda.is_available()

    def master_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin)


def make_placement(offload_cfg) -> DevicePlacement:
    """The placement for an ``OffloadOptimizerConfig``."""
    device = getattr(offload_cfg, "device", "none") if offload_cfg is not None else "none"
    if device == "cpu":
        return CPUPlacement(offload_cfg)
    if device == "nvme":
        raise NotImplementedError("zero_optimization.offload_optimizer.device='nvme' is not available yet; "
                                  "use 'cpu' or 'none'")
    return DevicePlacement()
