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

from typing import TYPE_CHECKING

import torch

from .param_swap import align_elems

if TYPE_CHECKING:  # offload/ never imports zero/ at run time (zero/ builds on offload/)
    from ..zero.stage3.group import ShardedParamGroup


class MasterIO:
    """Reads and writes a stage-3 group's compute-dtype shard by chunk, wherever it lives."""

    def __init__(self, groups: list["ShardedParamGroup"], dtype: torch.dtype):
        self.groups = groups
        self.align = align_elems(dtype)
        self.numels = [g.shard_numel for g in groups]  # the masters' sizes (their tensors are empty in memory)
        self._resident = [g.resident() if not g.in_memory else [] for g in groups]

    def init_master(self, index: int, lo: int, hi: int, out: torch.Tensor) -> None:
        """``out`` ([hi - lo] fp32) from group ``index``'s parameters."""
        g = self.groups[index]
        out.copy_(g.shard_flat[lo:hi] if g.in_memory else g.swap.read_range(g.base, lo, hi))

    def params_out(self, index: int, lo: int, hi: int, master: torch.Tensor) -> None:
        """Group ``index``'s parameters [lo, hi) from the updated fp32 ``master`` chunk."""
        g = self.groups[index]
        if g.in_memory:
            g.shard_flat[lo:hi].copy_(master)
        else:
            g.swap.write_range(g.base, lo, hi, master, self._resident[index])

    def flush(self) -> None:
        """Every parameter write has landed (the next gather may read them)."""
        for swap in {id(g.swap): g.swap for g in self.groups if not g.in_memory}.values():
            swap.flush()
