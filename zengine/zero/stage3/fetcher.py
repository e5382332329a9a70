"""Gathering and releasing stage-3 parameters: on demand, ahead of use, and checked across ranks.

``Fetcher.fetch(params, tag)`` makes the parameters whole (one collective
for all of them: each rank contributes its chunks, packed rank-major; a
single parameter is gathered straight into its own storage, which is already
rank-major, so nothing is staged or copied); ``release`` frees them again.
Both are called by the module hooks (``hooks.py``) in the same order on
every rank.

Prefetch: the first step records the sequence of fetches (the trace). Later
steps follow it: after fetching unit k, the next units are gathered
asynchronously, up to ``stage3_prefetch_bucket_size`` elements ahead and
never beyond ``stage3_max_live_parameters`` gathered elements. A parameter
released after forward is kept when the trace says it is fetched again
within ``stage3_max_reuse_distance`` elements (and the live limit allows).
When a step departs from the trace (a dynamic model), prefetch stops for the
rest of the step and fetching is on demand; this is logged once.

Always on, without a collective of its own (``FetchCheck``): every gather
is chained into a digest of what this rank gathered, and a gather of
several parameters carries a 4-element tag of its parameters' names in each
rank's row, compared on the device after the gather. The digest and the tag
mismatches ride on the boundary step's all-reduce (``step_stats.py``); when
the ranks disagree, every rank raises ``FetchOrderError`` before the
optimizer updates anything, naming the first gather where they parted (a
failure-path collective). A forward outside training checks the tags at its
end (one host read). Ranks that ran different modules (data-dependent control
flow, MoE routing) would otherwise gather different parameters in the same
collective: a hang on NCCL, or, when the sizes happen to agree, wrong values.

Debug (``stage3_debug_fetch_order``): before each fetch the ranks compare a
hash of what they are about to gather; if they differ, every rank raises an
error naming the fetch on each rank, instead of hanging in the collective.
"""
from __future__ import annotations

import logging
import weakref
import zlib
from collections import deque
from typing import Optional, Sequence

import torch

from ...distributed import collectives, diagnose
from ...offload.copies import device_streams
from .hierarchical import SecondaryPartition
from .param import ParamState, ShardedParam
from .quantized import ExactGather, gather_codec
from . import shm_gather

logger = logging.getLogger("zengine")
_LABEL_BYTES = 1024


class FetchOrderError(RuntimeError):
    """Ranks tried to gather different parameters at the same point: their programs diverged."""


_LOG = 65536  # gathers remembered for naming a divergence (a step of a large model issues a few thousand)
_TAG = 4  # elements of the in-band tag appended to each rank's row of a staged gather (bytes: exact in bf16/fp16)
_LEAF_HINT = diagnose.STAGE3_HINT + " Otherwise every rank must run the same modules in the same order."


class _Pending:
    """An asynchronous gather in flight: its staging buffer and works. ``direct``: the staging buffer is
    the parameter's own full storage (a unit of one parameter), so nothing is copied at the end.
    ``tag``: the expected in-band tag of a staged gather (its last ``_TAG`` columns), else None."""

    def __init__(self, params: list[ShardedParam], staging: torch.Tensor, works: list, direct: bool = False,
                 tag: Optional[torch.Tensor] = None):
        self.params, self.staging, self.works, self.direct, self.tag = params, staging, works, direct, tag
        self.decode = None  # a codec's finish (dequantize, a second hop): run once the gather lands
        self.widths: Optional[list[int]] = None  # a gather from the node's secondary shards: columns per param


def _tag_row(crc: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The crc's ``_TAG`` little-endian bytes as a [_TAG] row in ``dtype`` (bytes are exact in bf16/fp16), made
    on the device from a scalar: no upload from pageable host memory, which would make the host wait."""
    shifts = torch.arange(0, 8 * _TAG, 8, dtype=torch.int64, device=device)
    return ((torch.full((_TAG,), crc, dtype=torch.int64, device=device) >> shifts) & 0xFF).to(dtype)


class FetchCheck:
    """What this rank gathered since the last boundary step, to compare across ranks without a collective.

    ``digest``: crc32 chained over every gather's parameter names, in issue order; ``bad``: on the compute
    device, how many staged gathers came back with another rank's tag in a row (no host sync to update);
    ``log``: each gather's (unit crc, label parts), for naming the first divergence on the failure path."""

    def __init__(self, device: torch.device):
        self.device = device
        self.digest = 0
        self.bad: Optional[torch.Tensor] = None  # [1] float64 on the device, made at the first staged gather
        self.log: deque = deque(maxlen=_LOG)   # (unit crc, label, params) of the latest gathers
        self.issued_count = 0
        self._units: dict[tuple[int, ...], tuple[int, torch.Tensor | None]] = {}

    def unit(self, params: list[ShardedParam], dtype: torch.dtype, device: torch.device,
             staged: bool) -> tuple[int, Optional[torch.Tensor]]:
        """(crc of the unit's names, its expected tag row on ``device`` when ``staged``), made once per unit."""
        key = (*(id(sp) for sp in params), staged)
        known = self._units.get(key)
        if known is None or (known[1] is not None and known[1].dtype != dtype):
            crc = zlib.crc32("\0".join(sp.name for sp in params).encode())
            tag = _tag_row(crc, dtype, device) if staged else None
            known = self._units[key] = (crc, tag)
        return known

    def issued(self, crc: int, label: str, params: list[ShardedParam]) -> None:
        self.digest = zlib.crc32(crc.to_bytes(4, "little"), self.digest)
        self.log.append((crc, label, params))
        self.issued_count += 1

    def compare(self, rows: torch.Tensor, tag: torch.Tensor) -> None:
        """After a staged gather: count it when any rank's row carries another unit's tag (on the device)."""
        if self.bad is None:
            self.bad = torch.zeros(1, dtype=torch.float64, device=rows.device)
        self.bad += (rows != tag).any().to(torch.float64)

    def halves(self) -> tuple[int, int]:
        """The digest as two 16-bit values (their squares summed over ranks stay exact in float64)."""
        return self.digest >> 16, self.digest & 0xFFFF

    def reset(self) -> None:
        """A boundary step compared them: start over."""
        self.digest = 0
        self.log.clear()
        self.issued_count = 0
        if self.bad is not None:
            self.bad.zero_()


class Fetcher:
    """Gathers and releases sharded parameters for the hooks; keeps the live-element count."""

    def __init__(self, zero_cfg, world: int, rank: int, device: torch.device, comm_group=None, swap=None,
                 hpz: Optional[SecondaryPartition] = None, codec=None):
        self.world, self.rank, self.comm_group = world, rank, comm_group
        self.hpz = hpz  # zero_hpz_partition_size: backward gathers from the node's secondary shards
        self.device = device  # the compute device: the debug check's messages travel there
        self.prefetch_numel = int(zero_cfg.stage3_prefetch_bucket_size)
        self.max_live = int(zero_cfg.stage3_max_live_parameters)
        self.max_reuse = int(zero_cfg.stage3_max_reuse_distance)
        self.debug = bool(getattr(zero_cfg, "stage3_debug_fetch_order", False))
        self.live_numel = 0          # elements of non-persistent parameters gathered now
        self.peak_live_numel = 0     # the most seen since the last reset_peak()
        self.trace: Optional[list[tuple[str, tuple[int, ...]]]] = None  # recorded on the first step
        self._recording: list = []
        self._record = False
        self._pos = 0
        self._following = False
        self._warned_dynamic = False
        self._pending: dict[int, _Pending] = {}  # id(ShardedParam) -> its in-flight gather
        self._free_staging: list[torch.Tensor] = []  # released staging storage, reused within a step
        self._seq = 0
        self.swap = swap  # offload_param nvme: the ParamSwap whose reads follow the trace ahead of the gathers
        self.check = FetchCheck(device)
        # how gathers for compute travel (zero_quantized_weights: int8); gathers for the user stay exact
        self.exact = ExactGather()
        # (``codec``: MiCS's two-hop gather, two_hop.py)
        self.codec = codec or (gather_codec(zero_cfg) if world > 1 else self.exact)
        self._host_reads = None  # event after the latest uploads from host shards (_note_host_reads)
        position = weakref.WeakMethod(self._position)  # the registry must not keep an old engine alive
        diagnose.register_position("stage 3", lambda: position()() if position() is not None else "")

    @property
    def held_numel(self) -> int:
        """Elements of non-persistent parameters gathered or being gathered (a single-parameter gather
        in flight already occupies the parameter's storage)."""
        return self.live_numel + self._pending_numel()

    # -- the step's frame -----------------------------------------------------------------------
    def begin_step(self, training: bool) -> None:
        """A forward starts. Training steps record (first) or follow the trace; others fetch on demand."""
        self._pos = 0
        self._seq = 0
        self._recording = []
        self._record = training and self.trace is None
        self._following = training and self.trace is not None
        if self.hpz is not None:
            self.hpz.active = training
        if self.swap is not None:
            self.swap.check()

    def end_step(self) -> None:
        """Backward is over: keep the first step's sequence as the trace; drain stray prefetches."""
        if self._record and self._recording:
            self.trace = self._recording
        self._recording = []
        self._record = self._following = False
        self.drain()
        if self.hpz is not None:
            self.hpz.forget()
            self.hpz.active = False

    def drain(self) -> None:
        """Finish every gather in flight (a prefetch nobody used) and drop the staging storage."""
        for pending in list({id(p): p for p in self._pending.values()}.values()):
            self._finish(pending)
        self._free_staging = []
        if self.swap is not None:  # shards read ahead are stale once the step writes new ones
            self.swap.forget_prefetched()

    # -- fetch and release ----------------------------------------------------------------------
    def fetch(self, params: Sequence[ShardedParam], tag: str, exact: bool = False) -> None:
        """Make ``params`` whole; ranks must call this in the same order. ``exact``: never quantized (for the
        user's own use of the whole parameters)."""
        self._note(params, tag)
        todo = [sp for sp in params if sp.state is ParamState.SHARDED and id(sp) not in self._pending]
        waiting = {id(self._pending[id(sp)]): self._pending[id(sp)] for sp in params if id(sp) in self._pending}
        for pending in waiting.values():
            self._finish(pending)
        if todo:
            if self.debug:
                _check_order(self, todo, tag)
            self._finish(self._start(todo, tag, exact=exact))
        for sp in params:
            if not sp.persistent:
                sp.holders += 1
        self._prefetch_ahead()

    def release(self, params: Sequence[ShardedParam], force: bool = False) -> None:
        """Drop a hold on each parameter; free it when nobody holds it (or when ``force``)."""
        for sp in params:
            if sp.state is not ParamState.GATHERED or sp.persistent or sp.pinned:
                continue
            sp.holders = 0 if force else max(0, sp.holders - 1)
            if sp.holders == 0 and (force or not self._reused_soon(sp)):
                sp.free()
                self.live_numel -= sp.full.numel()

    def gather_now(self, params: Sequence[ShardedParam]) -> None:
        """Re-gather parameters that are already whole (after the step updated their shards)."""
        if params:
            self._finish(self._start(list(params), "re-gather after the step", refresh=True))
            self.drop_staging()

    def drop_staging(self) -> None:
        """Free the staging storage kept for reuse (outside a training step nothing should linger)."""
        self._free_staging = []

    # -- collectives ----------------------------------------------------------------------------
    def _start(self, params: list[ShardedParam], label: str, refresh: bool = False, exact: bool = False) -> _Pending:
        if self.hpz is not None and not (refresh or exact) and self.hpz.ready(params):
            return self._start_secondary(params, label)
        total = sum(sp.chunk for sp in params)
        dtype, device = params[0].full.dtype, params[0].full.device
        # One parameter: its full storage [world * chunk] is already laid out rank-major, so the gather lands
        # there directly (no staging buffer, no copy); several: one staging buffer, one collective for all,
        # each rank's row ending with the unit's tag (checked in _finish): [world, sum of chunks (+ tag)].
        direct = len(params) == 1
        crc, tag = self.check.unit(params, dtype, device, staged=not direct and self.world > 1)
        self.check.issued(crc, label, params)
        codec = self.exact if (refresh or exact) else self.codec
        if not codec.finishes and (transport := shm_gather.transport(self.comm_group, params, device)) is not None:
            return _start_shared(self, transport, params, tag, refresh)  # ranks on one host: shared memory
        staging = params[0].allocate() if direct else self._staging(total + (_TAG if tag is not None else 0), dtype, device)
        if tag is not None:
            staging[self.rank, total:].copy_(tag)
        if not _fill_row(staging[self.rank, :total], params, direct, device):
            self._note_host_reads(staging)
        try:
            works, coded = codec.start(staging, total, self.rank, self.comm_group)
        except RuntimeError as e:
            raise gather_failed(params, self.rank, self.check.issued_count, e) from e
        pending = _Pending(params, staging, works, direct, tag)
        # dequantize, or the two-hop's second hop
        pending.decode = (lambda: codec.finish(staging, total, coded)) if codec.finishes else None
        if not refresh:
            for sp in params:
                self._pending[id(sp)] = pending
        return pending

    def _finish(self, pending: _Pending) -> None:
        try:
            for w in pending.works:
                w.wait()
        except RuntimeError as e:
            raise gather_failed(pending.params, self.rank, self.check.issued_count, e) from e
        if pending.decode is not None:
            pending.decode()
            pending.decode = None
        if pending.tag is not None:
            self.check.compare(pending.staging[:, -_TAG:], pending.tag)
        col = 0
        for i, sp in enumerate(pending.params):
            self._pending.pop(id(sp), None)
            was_sharded = sp.state is ParamState.SHARDED
            width = sp.chunk if pending.widths is None else pending.widths[i]
            if not pending.direct:
                sp.allocate().view(pending.staging.shape[0], width).copy_(pending.staging[:, col:col + width])
            col += width
            if self.hpz is not None and pending.widths is None:
                self.hpz.keep(sp)  # in a training forward: this rank's piece for the backward's gather
            if was_sharded:
                sp.state = ParamState.GATHERED
                if not sp.persistent:
                    self.live_numel += sp.full.numel()
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel + self._pending_numel())
        pending.works = []
        if not pending.direct:  # a parameter's own storage is not staging to reuse
            self._free_staging.append(pending.staging.view(-1))
        pending.staging = None

    def _start_secondary(self, params: list[ShardedParam], label: str) -> _Pending:
        """hpZ: gather ``params`` from the node's secondary shards (hierarchical.py)."""
        crc, _ = self.check.unit(params, params[0].full.dtype, params[0].full.device, staged=False)
        self.check.issued(crc, label, params)
        widths = self.hpz.widths(params)
        staging = torch.empty(self.hpz.size, sum(widths), dtype=params[0].full.dtype, device=params[0].full.device)
        pending = _Pending(params, staging, self.hpz.start(params, staging))
        pending.widths = widths
        for sp in params:
            self._pending[id(sp)] = pending
        return pending

    def _staging(self, total: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [world, total] buffer carved from released staging storage when one fits (no fresh pages)."""
        need = self.world * total
        for i, store in enumerate(self._free_staging):
            if store.numel() >= need and store.dtype == dtype and store.device == device:
                return self._free_staging.pop(i)[:need].view(self.world, total)
        return torch.empty(self.world, total, dtype=dtype, device=device)

    def _pending_numel(self) -> int:
        unique = {id(p): p for p in self._pending.values()}
        return sum(sp.full.numel() for p in unique.values() for sp in p.params)

    # -- the trace: record, follow, prefetch, reuse ---------------------------------------------
    def _note(self, params: Sequence[ShardedParam], tag: str) -> None:
        key = (tag, tuple(id(sp) for sp in params))
        if self._record:
            self._recording.append((key, list(params)))
            return
        if not self._following:
            return
        if self._pos < len(self.trace) and self.trace[self._pos][0] == key:
            self._pos += 1
            return
        self._following = False
        if not self._warned_dynamic:
            self._warned_dynamic = True
            if self.rank == 0:
                logger.info("stage 3: module order changed from the recorded trace at %r; fetching on demand", tag)

    def _prefetch_ahead(self) -> None:
        if self._following and self.swap is not None:
            self._read_ahead()
        if not self._following or self.prefetch_numel <= 0:
            return
        budget = self.prefetch_numel - self._pending_numel()
        pos = self._pos
        while pos < len(self.trace) and budget > 0:
            _, params = self.trace[pos]
            todo = [sp for sp in params if sp.state is ParamState.SHARDED and id(sp) not in self._pending]
            size = sum(sp.full.numel() for sp in todo)
            if todo:
                if size > budget or self.live_numel + self._pending_numel() + size > self.max_live:
                    break
                if self.debug:
                    _check_order(self, todo, self.trace[pos][0][0] + " (prefetch)")
                self._start(todo, self.trace[pos][0][0] + " (prefetch)")
                budget -= size
            pos += 1

    def _read_ahead(self) -> None:
        """Start reading the NVMe shards the trace gathers next, as far as the swap's buffers go."""
        for _, params in self.trace[self._pos:]:
            todo = [sp for sp in params if sp.state is ParamState.SHARDED and sp.shard is None
                    and sp.store is self.swap and id(sp) not in self._pending]
            if todo and not self.swap.prefetch(todo):
                return

    def _reused_soon(self, sp: ShardedParam) -> bool:
        """True when the trace fetches ``sp`` again within max_reuse_distance elements, and keeping it
        still leaves room under max_live_parameters for the next unit to be fetched."""
        if not self._following or self.max_reuse <= 0:
            return False
        upcoming = self.trace[self._pos:]
        next_size = sum(p.full.numel() for p in upcoming[0][1] if p.state is ParamState.SHARDED) if upcoming else 0
        if self.live_numel + self._pending_numel() + next_size > self.max_live:
            return False
        distance = 0
        for _, params in upcoming:
            if any(p is sp for p in params):
                return distance <= self.max_reuse
            distance += sum(p.numel for p in params)
            if distance > self.max_reuse:
                return False
        return False

    # -- host shards read by the device (offload_param) ----------------------------------------
    def _note_host_reads(self, staging: torch.Tensor) -> None:
        """Uploads from host shards were queued (non_blocking): remember the point of the compute stream
        after them, so that the step waits for it before it writes those shards in place."""
        streams = device_streams(staging.device)
        if streams is not None:
            self._host_reads = streams.Event()
            self._host_reads.record(streams.current_stream(staging.device))

    def host_reads_done(self) -> None:
        """Before the step updates host shards in place (CPU-Adam on offload_param's shards): every upload
        queued from them has finished reading them (one event; nothing to wait for on the host itself)."""
        if self._host_reads is not None:
            self._host_reads.synchronize()
            self._host_reads = None

    # -- the always-on check (FetchCheck) -------------------------------------------------------
    def boundary_values(self) -> tuple[int, int, Optional[torch.Tensor]]:
        """For the boundary step's all-reduce: the digest's two halves and the device count of bad tags."""
        d1, d2 = self.check.halves()
        return d1, d2, self.check.bad

    def end_forward(self, training: bool) -> None:
        """After a forward outside training: raise if a staged gather came back mixed (one host read;
        a training forward is checked at its boundary step instead)."""
        if training or self.world == 1:
            return
        if self.check.bad is not None and float(self.check.bad) > 0:  # every rank saw the mixed rows: all raise
            self.raise_diverged()

    def raise_diverged(self) -> None:
        """Every rank calls this together once the sums show the ranks gathered differently (see
        ``raise_fetches_diverged``)."""
        raise_fetches_diverged(self.check, self.device, self.comm_group, self.world)

    def _position(self) -> str:
        """For a failed collective's report: this rank's latest gather."""
        if not self.check.log:
            return ""
        _, label, params = self.check.log[-1]
        return f"latest stage-3 gather {self.check.issued_count}: {label} [{', '.join(sp.name for sp in params)}]"


def _start_shared(self: "Fetcher", transport, params: list[ShardedParam], tag: Optional[torch.Tensor],
                  refresh: bool) -> _Pending:
    """Ranks on one host: gather straight from the shards into the parameters through shared memory
    (``shm_gather.py``), done before this returns; the pending gather left for ``_finish`` keeps the books."""
    tags = shm_gather.gather(transport, params, tag)
    if tags is not None:
        self.check.compare(tags, tag)
    pending = _Pending(params, None, [], direct=True)  # direct: nothing to copy out
    if not refresh:
        for sp in params:
            self._pending[id(sp)] = pending
    return pending


def _check_order(self: "Fetcher", params: list[ShardedParam], tag: str) -> None:
    """stage3_debug_fetch_order: before a fetch, the ranks compare what they are about to gather."""
    self._seq += 1
    label = f"#{self._seq} {tag} [{', '.join(sp.name for sp in params)}]"
    digest = torch.tensor([zlib.crc32(label.encode())], dtype=torch.int64).to(self.device)
    everyone = collectives.all_gather_small(digest, self.comm_group).view(-1).tolist()  # a debug mode: a host read is fine
    if any(d != everyone[self.rank] for d in everyone):
        labels = exchange_labels(label, self.device, self.comm_group, self.world)
        lines = "\n".join(f"  rank {r}: {lab}" for r, lab in enumerate(labels))
        raise FetchOrderError(f"stage 3: ranks diverged at parameter fetch {self._seq}; each rank was about "
                              f"to gather:\n{lines}\nThe ranks ran different modules (data-dependent control "
                              f"flow?); every rank must run the same modules in the same order.")


def _fill_row(row: torch.Tensor, params: list[ShardedParam], direct: bool, device: torch.device) -> bool:
    """This rank's chunks of ``params`` into its ``row`` of a gather. True when they all came from shards on
    the device; else some came from host memory or NVMe (offload_param) and the caller notes the reads."""
    for sp in params:  # shards on NVMe: every read in flight at once
        if sp.shard is None:
            sp.store.start_read(sp)
    if not direct and all(sp.shard is not None and sp.shard.device == device for sp in params):
        # shards on the device: one multi-tensor copy into this rank's row rather than a launch per shard
        torch._foreach_copy_(list(row.split([sp.chunk for sp in params])), [sp.shard for sp in params])
        return True
    col = 0
    for sp in params:
        source = sp.shard if sp.shard is not None else sp.store.take(sp)  # host memory with offload_param
        row[col:col + sp.chunk].copy_(source, non_blocking=True)
        if sp.shard is None:
            sp.store.give_back(sp)
        col += sp.chunk
    return False


# -- the failure path of the gather check: one exchange, then the error -------------------------------
def raise_fetches_diverged(check: FetchCheck, device: torch.device, comm_group, world: int) -> None:
    """Every rank calls this together once the sums show the ranks gathered differently: one failure-path
    exchange of the gathers each rank issued, then FetchOrderError naming where they parted."""
    crcs = [c for c, _, _ in check.log]
    first = check.issued_count - len(crcs)  # index of the oldest gather still in the log
    counts = collectives.all_gather_small(torch.tensor([check.issued_count, first], dtype=torch.int64)
                                          .to(device), comm_group).view(-1, 2).cpu().tolist()
    longest = max(n for n, _ in counts)
    start = max(f for _, f in counts)
    mine = torch.full((max(longest - start, 1),), -1, dtype=torch.int64)
    window = crcs[start - first:]
    mine[:len(window)] = torch.tensor(window, dtype=torch.int64)
    rows = collectives.all_gather_small(mine.to(device), comm_group).view(world, -1).cpu()
    differ = (rows != rows[0]).any(dim=0).nonzero()
    at = int(differ[0]) if len(differ) else 0
    index = start + at
    entry = check.log[index - first] if first <= index < check.issued_count else None
    label = (f"{entry[1]} [{', '.join(sp.name for sp in entry[2])}]" if entry is not None
             else "(nothing: this rank had gathered less)")
    labels = exchange_labels(label, device, comm_group, world)
    lines = "\n".join(f"  rank {r}: gather {index + 1} of {n}: {lab}" for r, (lab, (n, _)) in
                      enumerate(zip(labels, counts)))
    check.reset()
    raise FetchOrderError(f"stage 3: the ranks gathered different parameters in the same collective "
                          f"(caught before any update; each rank's gather where they first parted):\n{lines}\n"
                          + _LEAF_HINT)


def exchange_labels(label: str, device: torch.device, comm_group, world: int) -> list[str]:
    """Every rank's label, as fixed-size byte tensors (all_gather_object would need numpy)."""
    raw = label.encode()[:_LABEL_BYTES]
    mine = torch.zeros(_LABEL_BYTES, dtype=torch.uint8)
    mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    gathered = collectives.all_gather_small(mine.to(device), comm_group).view(world, -1).cpu()
    return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]


def gather_failed(params: list[ShardedParam], rank: int, count: int, error: RuntimeError) -> BaseException:
    """A gather the backend refused (gloo: the ranks' sizes differ): name it on this rank. A failure the
    diagnosis already named (a timeout, a peer gone: each rank's position in its report) stays as it is."""
    if error is diagnose.first_reported() or isinstance(error, (diagnose.CollectiveTimeoutError,
                                                                diagnose.RanksOutOfStepError)):
        return error
    return FetchOrderError(f"stage 3: rank {rank}'s gather {count} of "
                           f"[{', '.join(sp.name for sp in params)}] failed ({type(error).__name__}: {error}); "
                           f"the likely cause is ranks gathering different parameters at this point.\n"
                           + _LEAF_HINT)
