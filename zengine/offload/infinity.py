"""ZeRO-Infinity's optimizer side at stage 3: what the NVMe-swapped step needs from the groups.

With ``offload_optimizer.device = "nvme"`` at stage 3 the fp32 masters and the gradient shards
are swapped with Adam's moments (``swap.SwappedAdam``: a record ``[exp_avg | exp_avg_sq |
master | grad]`` per chunk), so host memory for the optimizer is the swap buffers. The step
then needs two things from the parameter groups, which ``MasterIO`` gives it:

- ``init_master``: a chunk never stepped starts from the compute-dtype parameters (as a master
  in memory is made from them);
- ``params_out``: the updated chunk, cast to the compute dtype, goes where the parameters live
  (the parameter swap file with ``offload_param.device = "nvme"``, else the group's shard).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .copies import HostCopies
from .param_swap import align_elems

if TYPE_CHECKING:  # offload/ never imports zero/ at run time (zero/ builds on offload/)
    from ..zero.stage3.group import ShardedParamGroup


class MasterIO:
    """Reads and writes a stage-3 group's compute-dtype shard by chunk, wherever it lives; ``copies``
    (``copies.py``) moves the chunks of a shard on the device, without the host waiting for each."""

    def __init__(self, groups: list["ShardedParamGroup"], dtype: torch.dtype, copies: Optional[HostCopies] = None):
        self.groups = groups
        self.align = align_elems(dtype)
        self.numels = [g.shard_numel for g in groups]  # the masters' sizes (their tensors are empty in memory)
        self._resident = [g.resident() if not g.in_memory else [] for g in groups]
        self.copies = copies if copies is not None else HostCopies()
        self._landings: list = []  # init_master copies from the device not yet waited for

    def init_master(self, index: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` ([hi - lo] fp32) from group ``index``'s parameters; read it after ``ready()``."""
        g = self.groups[index]
        if g.in_memory:  # (queued while the chunks before it step: the swap reads this chunk ahead)
            self._landings.append(self.copies.download(out, g.shard_flat[lo:hi]))
        else:
            out.copy_(g.swap.read_range(g.base, lo, hi))

    def ready(self) -> None:
        """Every ``init_master`` so far has landed."""
        for landing in self._landings:
            landing.synchronize()
        self._landings = []

    def params_out(self, index: int, lo: int, hi: int, master: torch.Tensor) -> None:
        """Group ``index``'s parameters [lo, hi) from the updated fp32 ``master`` chunk (which may be
        rewritten as soon as this returns)."""
        g = self.groups[index]
        if g.in_memory:
            self.copies.upload(g.shard_flat[lo:hi], master)
        else:
            g.swap.write_range(g.base, lo, hi, master, self._resident[index])

    def flush(self) -> None:
        """Every parameter write has landed (the next gather may read them)."""
        for swap in {id(g.swap): g.swap for g in self.groups if not g.in_memory}.values():
            swap.flush()
