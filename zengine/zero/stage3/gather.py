"""Gathering one unit of stage-3 parameters: stateless functions over a list of sharded parameters.

The shape is FSDP2's (``foreach_all_gather``, then ``foreach_all_gather_copy_out``): the start
copies this rank's chunks into its row of one buffer and launches one collective for the whole unit;
the copy-out waits for it and copies each parameter's columns out of every rank's row into the
parameter's own storage. Several parameters share a staging buffer
``[world, sum of chunks (+ tag)]`` whose rows end with the unit's tag (``fetch_check.py``); a single
parameter is gathered straight into its own storage ``[world, chunk]``, which is already rank-major,
so nothing is staged or copied.

How the rows travel is the codec's (``GatherCodec``): as they are (``ExactGather``), as blockwise
int8 (``quantized.Int8Gather``, ZeRO++), or in two hops across and inside the nodes
(``two_hop.TwoHopGather``, MiCS). The gathers that skip the staged rows make the same
``InFlightGather``: through shared memory (``shm_gather.py``) and from the node's secondary shards
(``hierarchical.py``, hpZ).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from ...device import reuses_freed_blocks
from ...distributed import collectives
from .fetch_check import TAG, FetchCheck, gather_failed
from .param import ShardedParam


class GatherCodec(Protocol):
    """How the rows of a staged gather travel between the ranks: ``ExactGather`` (below),
    ``quantized.Int8Gather`` (ZeRO++'s int8 weights), ``two_hop.TwoHopGather`` (MiCS's two hops)."""

    finishes: bool  # True when the rows need work once the collective lands (``finish``)
    # True when a row's values depend on what else travels in it (blockwise scales): then gathers
    # are not coalesced into groups (trace.py), so a parameter gathers to the same values every time
    values_depend_on_row: bool

    def start(self, staging: torch.Tensor, ncols: int, rank: int, group: Any) -> tuple[list, Any]:
        """Launch the gather of ``staging``'s rows (this rank's filled); the works and the codec's
        state."""
        ...

    def finish(self, staging: torch.Tensor, ncols: int, state: Any) -> None:
        """After the works are waited for: every rank's row in ``staging``, columns [0, ncols)."""
        ...


class ExactGather:
    """All-gather the staging rows as they are."""

    finishes = False  # nothing to do after the gather lands
    values_depend_on_row = False

    def start(self, staging: torch.Tensor, ncols: int, rank: int, group: Any) -> tuple[list, Any]:
        """All-gather ``staging``'s rows asynchronously; no state to finish with."""
        return collectives.all_gather_rows(staging, rank, group, async_op=True), None

    def finish(self, staging: torch.Tensor, ncols: int, state: Any) -> None:
        """Nothing: the rows arrived as they were sent."""


EXACT = ExactGather()


@dataclass(frozen=True)
class GatherGroup:
    """The ranks a gather spans: their process group, how many they are, this rank's place among
    them."""

    group: Any
    world: int
    rank: int


class InFlightGather:
    """A unit's gather between its start and its copy-out (FSDP2's ``AllGatherResult``).

    ``staging``: the rows, ``[ranks, sum of widths (+ tag)]``, or the parameter's own storage when
    ``direct`` (nothing to copy out; None once the shared-memory gather has written the parameters).
    ``widths``: each parameter's columns in a row. ``tag``: the unit's expected tag, in the last
    ``TAG`` columns of a staged gather, else None. ``codec``/``coded``: whose ``finish`` runs once
    it lands. ``from_secondary``: gathered from hpZ's secondary shards (so not kept as secondary
    shards again).
    """

    def __init__(
        self,
        params: list[ShardedParam],
        staging: Optional[torch.Tensor],
        works: list,
        widths: list[int],
        direct: bool = False,
        tag: Optional[torch.Tensor] = None,
        codec: GatherCodec = EXACT,
        coded: Any = None,
        from_secondary: bool = False,
    ):
        self.params, self.staging, self.works, self.widths = params, staging, works, widths
        self.direct, self.tag, self.codec, self.coded = direct, tag, codec, coded
        self.from_secondary = from_secondary

    @property
    def ncols(self) -> int:
        """Columns of the parameters' data in a row (the tag's follow)."""
        return sum(self.widths)

    def recycle(self, pool: "StagingPool") -> None:
        """Landed and copied out: a staging buffer goes back to ``pool`` (a parameter's own storage
        does not)."""
        if not self.direct:
            pool.give(self.staging)
        self.works, self.staging = [], None


class StagingPool:
    """Released staging storage, reused by the next gathers of a step (no fresh pages for each):
    for the host, whose allocator returns large blocks to the system and faults them in again.
    A device with a caching allocator reuses freed blocks itself: there ``FreedStaging``."""

    def __init__(self):
        self._free: list[torch.Tensor] = []  # flat views of released staging buffers

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [rows, cols] buffer carved from released storage when one fits, else a fresh one."""
        need = rows * cols
        for i, store in enumerate(self._free):
            if store.numel() >= need and store.dtype == dtype and store.device == device:
                return self._free.pop(i)[:need].view(rows, cols)
        return torch.empty(rows, cols, dtype=dtype, device=device)

    def give(self, staging: torch.Tensor) -> None:
        """``staging`` is free to reuse."""
        self._free.append(staging.view(-1))

    def clear(self) -> None:
        """Drop the storage kept for reuse (outside a training step nothing should linger)."""
        self._free = []


class FreedStaging(StagingPool):
    """Staging freed as soon as its gather is copied out: on a device with a caching allocator
    (CUDA), which hands the same blocks to the next gathers without new device allocations, a pool
    of our own would only hold them while backward's activations peak (counted by
    ``max_memory_allocated``: 1.08 bytes a parameter of a 4-block GPT, bench_device_memory.py)."""

    def give(self, staging: torch.Tensor) -> None:
        """Dropped: the allocator reuses it."""


def staging_pool(device: torch.device) -> StagingPool:
    """The staging pool for gathers on ``device``: kept storage on the host, freed on a device."""
    return FreedStaging() if reuses_freed_blocks(device) else StagingPool()


def copy_in(
    row: torch.Tensor, params: list[ShardedParam], direct: bool, device: torch.device
) -> bool:
    """This rank's chunks of ``params`` into its ``row`` of a gather. True when they all came from
    shards on the device; else some came from host memory or NVMe (offload_param) and the caller
    notes the reads."""
    for sp in params:  # shards on NVMe: every read in flight at once
        if sp.shard is None:
            sp.swap_file.start_read(sp)
    if not direct and all(sp.shard is not None and sp.shard.device == device for sp in params):
        # shards on the device: one multi-tensor copy into this rank's row, not a launch per shard
        torch._foreach_copy_(
            list(row.split([sp.chunk for sp in params])), [sp.shard for sp in params]
        )
        return True
    col = 0
    for sp in params:
        # host memory with offload_param
        source = sp.shard if sp.shard is not None else sp.swap_file.take(sp)
        row[col : col + sp.chunk].copy_(source, non_blocking=True)
        if sp.shard is None:
            sp.swap_file.give_back(sp)
        col += sp.chunk
    return False


def foreach_all_gather(
    params: list[ShardedParam],
    tag: Optional[torch.Tensor],
    codec: GatherCodec,
    ranks: GatherGroup,
    pool: StagingPool,
    check: FetchCheck,
    note_host_reads: Callable[[torch.Tensor], None],
) -> InFlightGather:
    """Copy this rank's chunks of ``params`` in and launch the gather of every rank's
    (asynchronous). ``tag``: the unit's tag row, sent at the end of the row (several parameters
    only); ``note_host_reads``: told the buffer when chunks were uploaded from host shards."""
    total = sum(sp.chunk for sp in params)
    dtype, device = params[0].full.dtype, params[0].full.device
    direct = len(params) == 1
    if direct:
        staging = params[0].allocate()  # [world, chunk]: the parameter's own storage
    else:  # [world, sum of chunks (+ tag)]
        staging = pool.take(ranks.world, total + (TAG if tag is not None else 0), dtype, device)
    if tag is not None:
        staging[ranks.rank, total:].copy_(tag)
    if not copy_in(staging[ranks.rank, :total], params, direct, device):
        note_host_reads(staging)
    try:
        works, coded = codec.start(staging, total, ranks.rank, ranks.group)
    except RuntimeError as e:
        raise gather_failed(params, ranks.rank, check.issued_count, e) from e
    widths = [sp.chunk for sp in params]
    return InFlightGather(params, staging, works, widths, direct, tag, codec, coded)


def foreach_all_gather_copy_out(gather: InFlightGather, check: FetchCheck, rank: int) -> None:
    """Wait for ``gather``, let its codec finish (dequantize, the second hop), compare its tag, and
    copy each parameter's columns of every rank's row into the parameter's own storage."""
    try:
        for w in gather.works:
            w.wait()
    except RuntimeError as e:
        raise gather_failed(gather.params, rank, check.issued_count, e) from e
    gather.codec.finish(gather.staging, gather.ncols, gather.coded)
    gather.codec = EXACT  # finished once
    if gather.tag is not None:
        check.compare(gather.staging[:, -TAG:], gather.tag)
    if gather.direct:
        return
    rows, col = gather.staging.shape[0], 0
    for sp, width in zip(gather.params, gather.widths):
        sp.allocate().view(rows, width).copy_(gather.staging[:, col : col + width])
        col += width
