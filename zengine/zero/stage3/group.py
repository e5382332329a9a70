"""A stage-3 optimizer param group: the concatenated chunks of its trainable parameters.

It plays the same role as ``FlatParamGroup`` (``zero/flat_group.ParamGroup``,
as ``zero/optimizer.py`` sees it): this rank's shard (in the compute dtype, or in the masters' when
the placement makes the shard the master: ``offload/placement.py`` ``shard_dtype``), where each
parameter's elements sit in it, the part for the global norm, and what to do
after the step (here: refresh the persistent parameters, which stay whole).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...offload import pinned
from ...offload.param_swap import on_disk, round_up
from .param import ParamState, ShardedParam


class ShardedParamGroup:
    """This rank's chunks of one param group's trainable parameters, end to end in ``shard_flat`` (a
    ``zero/flat_group.ParamGroup``)."""

    def __init__(
        self,
        sharded: Sequence[ShardedParam],
        hyper: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
        refresh: Callable[[list[ShardedParam]], None],
        pin: bool = False,
        swap=None,
        align: int = 1,
        primary: bool = True,
    ):
        self.sharded = list(sharded)
        self.primary = primary  # False: another rank's identical copy is counted and saved (MiCS, zero/mics.py)
        self.params = [sp.param for sp in self.sharded]
        self.hyper = hyper
        self.swap = (
            swap  # NVMe offload (nvme.ParamSwap): the shards live in its file, not in memory
        )
        # O_DIRECT (NVMe swapping): each chunk starts on an aligned element, and the shard ends on one
        align = max(align, swap.align if swap is not None else 1)
        self.offsets = []
        offset = 0
        for sp in self.sharded:
            self.offsets.append(offset)
            offset += round_up(sp.chunk, align)
        self.shard_numel = round_up(offset, align)
        if swap is None:
            # [sum of chunks] in the group's dtype; on the host with offload_param (pinned on a GPU machine, sized exactly)
            self.shard_flat = (
                pinned.zeros(self.shard_numel, dtype, kind=pinned.PARAMETERS)
                if pin
                else torch.zeros(self.shard_numel, dtype=dtype, device=device)
            )
            for sp, off in zip(self.sharded, self.offsets):
                sp.attach_shard(self.shard_flat.narrow(0, off, sp.chunk))
        else:
            self.shard_flat = on_disk(dtype)  # [0]: the [shard_numel] values are in the file
            self.base = swap.add_group(self.shard_numel)
            for sp, off in zip(self.sharded, self.offsets):
                swap.check_fits(sp.name, round_up(sp.chunk, align))
                sp.move_to_swap(swap, self.base + off, swap.keep_resident(sp.chunk))
        self.used = [False] * len(self.params)
        self._refresh = refresh

    def lost_writes(self) -> list[tuple[str, str]]:
        """(name, why) of each parameter a script wrote in a way the engine loses (``.data``
        replaced, or written in place while partitioned; zero/param_writes.py)."""
        return [(sp.name, why) for sp in self.sharded if (why := sp.user_write()) is not None]

    @property
    def in_memory(self) -> bool:
        """False when the shards live in an NVMe swap file (``shard_flat`` then has no storage)."""
        return self.swap is None

    def resident(self) -> list[tuple[ShardedParam, int]]:
        """(parameter, offset) of the NVMe-offloaded shards also kept in host memory (max_in_cpu)."""
        return [(sp, off) for sp, off in zip(self.sharded, self.offsets) if sp.shard is not None]

    def write_from(self, master: torch.Tensor, chunk: int) -> None:
        """NVMe: write the compute-dtype shards from the fp32 ``master`` ([shard_numel]), ``chunk`` at a time."""
        resident = self.resident()
        for lo in range(0, self.shard_numel, chunk):
            hi = min(self.shard_numel, lo + chunk)
            self.swap.write_range(self.base, lo, hi, master[lo:hi], resident)
        self.swap.flush()

    def read_into(self, master: torch.Tensor, chunk: int) -> None:
        """NVMe: fill the fp32 ``master`` ([shard_numel]) from the shards in the file."""
        for lo in range(0, self.shard_numel, chunk):
            hi = min(self.shard_numel, lo + chunk)
            master[lo:hi].copy_(self.swap.read_range(self.base, lo, hi))

    @property
    def owned(self) -> tuple[int, int]:
        return 0, self.shard_numel

    def params_version(self) -> int:
        """The shard buffer's version counter (the gathered parameters are other storage: writes to them reach
        the shard through GatheredParameters / summon_full_params, which keep the masters in step)."""
        return self.shard_flat._version

    def owned_params(self) -> torch.Tensor:
        return self.shard_flat

    def master_pieces(self) -> list[tuple[int, int, int]]:
        return [
            (i, off, off + sp.valid)
            for i, (sp, off) in enumerate(zip(self.sharded, self.offsets))
            if sp.valid
        ]

    replicated = False  # each rank holds its own chunk of every parameter

    def param_pieces(self, pi: int) -> list[tuple[int, int, int]]:
        """(lo, hi, start): shard[lo:hi] holds parameter pi's flat elements from ``start`` on."""
        sp, off = self.sharded[pi], self.offsets[pi]
        return [(off, off + sp.valid, sp.rank * sp.chunk)] if sp.valid else []

    def param_shape(self, pi: int) -> tuple:
        return tuple(self.sharded[pi].shape)

    def norm_range(self, world: int) -> tuple[int, int]:
        """What of the shard this rank counts in the gradient norm and writes to a checkpoint: all of it, or
        nothing when it is a MiCS copy of another rank's shard."""
        return (0, self.shard_numel) if self.primary else (0, 0)

    def publish(self, bucket_numel: int, comm_group=None) -> None:
        """Parameters that stay gathered (persistent ones) are re-gathered from the updated shards."""
        live = [sp for sp in self.sharded if sp.state is ParamState.GATHERED]
        if live:
            self._refresh(live)

    def param_names(self) -> list[str]:
        """The parameters' names, in ``params`` order."""
        return [sp.name for sp in self.sharded]

    def tensors(self) -> list[torch.Tensor]:
        flat = [self.shard_flat] if self.swap is None else [sp.shard for sp, _ in self.resident()]
        return flat + [sp.full for sp in self.sharded if sp.state is ParamState.GATHERED]
