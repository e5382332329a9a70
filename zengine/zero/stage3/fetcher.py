"""Gathering and releasing stage-3 parameters: on demand, ahead of use, and checked across ranks.

``Fetcher.fetch(params, tag)`` makes the parameters whole (one collective for all of them);
``release`` frees them again. Both are called by the module hooks (``hooks.py``) in the same order
on every rank. The Fetcher composes the parts that do the work, one job each:

- ``gather.py``: the gather of one unit, stateless (copy-in, the collective through a
  ``GatherCodec``, copy-out), and its ways around the staged rows: ``shm_gather.py`` (ranks on one
  host), ``hierarchical.py`` (hpZ: the backward from the node's secondary shards);
- ``trace.py``: the order recorded at the first step, the prefetch and reuse that follow it, the
  debug check of the order, and the reads ahead from the parameter swap file;
- ``holds.py``: the gathers in flight, the forward's holds, and the live-element count;
- ``fetch_check.py``: the always-on check that the ranks gathered the same parameters.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch

from ...distributed import diagnose, identity
from ...offload.copies import device_streams
from . import shm_gather
from .fetch_check import FetchCheck, FetchOrderError, raise_fetches_diverged
from .gather import (
    EXACT,
    GatherCodec,
    GatherGroup,
    InFlightGather,
    staging_pool,
    foreach_all_gather,
    foreach_all_gather_copy_out,
)
from .hierarchical import NoSecondaryPartition, SecondaryShards
from .holds import Holds
from .param import ParamState, ShardedParam
from .quantized import gather_codec
from .trace import NoReadAhead, ReadAhead, Trace, order_check
from .units import GatherUnits
from .two_hop import gather_codec_for

__all__ = ["Fetcher", "FetchOrderError", "compute_codec"]


def compute_codec(zero_cfg: Any, world: int) -> GatherCodec:
    """How the gathers for compute travel: MiCS's two hops (``mics_hierarchical_params_gather``
    across nodes), else ZeRO++'s int8 (``zero_quantized_weights``, several ranks), else exact."""
    return gather_codec_for(zero_cfg, world) or (gather_codec(zero_cfg) if world > 1 else EXACT)


class HostReads:
    """Uploads from host shards (offload_param) the step lets finish before it writes them."""

    def __init__(self):
        self._event = None  # the compute stream's point after the latest uploads

    def note(self, staging: torch.Tensor) -> None:
        """Uploads from host shards were queued (non_blocking): remember the point of the compute
        stream after them, so that the step waits for it before it writes those shards in place."""
        streams = device_streams(staging.device)
        if streams is not None:
            self._event = streams.Event()
            self._event.record(streams.current_stream(staging.device))

    def done(self) -> None:
        """Wait until every upload queued from host shards has finished reading them."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None


class Fetcher:
    """Gathers and releases sharded parameters for the hooks (see the module doc)."""

    def __init__(
        self,
        zero_cfg: Any,
        world: int,
        rank: int,
        device: torch.device,
        comm_group: Any = None,
        read_ahead: ReadAhead = NoReadAhead(),
        secondary: SecondaryShards = NoSecondaryPartition(),
        codec: GatherCodec = EXACT,
    ):
        self.world, self.rank, self.comm_group = world, rank, comm_group
        self.ranks = GatherGroup(comm_group, world, rank)
        self.device = device  # the compute device: the checks' messages travel there
        self.max_live = int(zero_cfg.stage3_max_live_parameters)
        units = GatherUnits.from_config(zero_cfg)  # (the "auto" units' lifetimes: units.py)
        self.trace = Trace(
            int(zero_cfg.stage3_prefetch_bucket_size),
            units.reuse_distance,
            rank,
            coalesce=units.coalesce and not codec.values_depend_on_row,
        )
        self.order_check = order_check(zero_cfg, device, comm_group, rank, world)
        self.holds = Holds()
        self.pool = staging_pool(device)  # (kept on the host, freed on a device)
        self.check = FetchCheck(device)
        self.host_reads = HostReads()
        # offload_param nvme: the shards the gathers need next are read from the swap file ahead
        self.read_ahead = read_ahead
        # zero_hpz_partition_size: the backward gathers from the node's secondary shards
        self.secondary = secondary
        self.codec = codec  # how gathers for compute travel; gathers for the user stay exact
        # the registry must not keep an old engine alive
        position = weakref.WeakMethod(self._position)
        diagnose.register_position(
            "stage 3", lambda: position()() if position() is not None else ""
        )

    @property
    def held_numel(self) -> int:
        """Elements of non-persistent parameters gathered or being gathered (a single-parameter
        gather in flight already occupies the parameter's storage)."""
        return self.holds.held_numel

    @property
    def peak_live_numel(self) -> int:
        """The most elements gathered or in flight at once."""
        return self.holds.peak_live_numel

    # -- the step's frame -----------------------------------------------------------------------
    def begin_step(self, training: bool) -> None:
        """A forward starts. Training steps record (first) or follow the trace; others fetch on
        demand."""
        self.trace.begin_step(training)
        self.order_check.begin_step()
        self.secondary.begin(training)
        self.read_ahead.begin_step()

    def end_step(self) -> None:
        """Backward is over: keep the first step's sequence as the trace; drain stray prefetches."""
        self.trace.end_step()
        self.drain()
        self.secondary.end()

    def drain(self) -> None:
        """Finish every gather in flight (a prefetch nobody used) and drop the staging storage."""
        for gather in self.holds.all_in_flight():
            self._finish(gather)
        self.pool.clear()
        self.read_ahead.forget()

    # -- fetch and release ----------------------------------------------------------------------
    def fetch(self, params: Sequence[ShardedParam], tag: str, exact: bool = False) -> None:
        """Make ``params`` whole; ranks must call this in the same order. ``exact``: never quantized
        (for the user's own use of the whole parameters)."""
        self.trace.note(params, tag)
        todo = [
            sp for sp in params if sp.state is ParamState.SHARDED and not self.holds.in_flight(sp)
        ]
        for gather in self.holds.gathers_of(params):
            self._finish(gather)
        if todo:
            # opening a gather group of the trace: the rest of the group travels in this collective
            rest = [] if exact else self._rest_of_group(todo)
            label = tag if not rest else f"{tag} +{len(rest)} of its group"
            self.order_check.before(todo + rest, label)
            self._finish(self._start(todo + rest, label, exact=exact))
        self.holds.hold(params)
        self._prefetch_ahead()

    def release(self, params: Sequence[ShardedParam], force: bool = False) -> None:
        """Drop a hold on each parameter; free it when nobody holds it (or when ``force``)."""
        self.holds.release(params, force, self._reused_soon)

    def gather_now(self, params: Sequence[ShardedParam]) -> None:
        """Re-gather parameters that are already whole (after the step updated their shards)."""
        if params:
            self._finish(self._start(list(params), "re-gather after the step", refresh=True))
            self.drop_staging()

    def drop_staging(self) -> None:
        """Free the staging storage kept for reuse (nothing lingers outside a training step)."""
        self.pool.clear()

    # -- gathers: started, finished -------------------------------------------------------------
    def _start(
        self, params: list[ShardedParam], label: str, refresh: bool = False, exact: bool = False
    ) -> InFlightGather:
        """Start gathering ``params``: from hpZ's secondary shards in a training backward, else from
        every rank (``refresh``/``exact``: for the user, exact and from the primary shards)."""
        for_user = refresh or exact
        if not for_user and self.secondary.ready(params):
            gather = self._start_secondary(params, label)
        else:
            gather = self._start_primary(params, label, EXACT if for_user else self.codec)
        if not refresh:  # a re-gather after the step is finished at once, not waited on by a fetch
            self.holds.track(gather)
        return gather

    def _start_primary(
        self, params: list[ShardedParam], label: str, codec: GatherCodec
    ) -> InFlightGather:
        # one parameter gathers into its own storage; several carry the unit's tag (checked later)
        dtype, device = params[0].full.dtype, params[0].full.device
        staged = len(params) > 1 and self.world > 1
        crc, tag = self.check.unit(params, dtype, device, staged=staged)
        self.check.issued(crc, label, params)
        # ranks on one host: through shared memory (rows a codec transforms go through the backend)
        transport = (
            None if codec.finishes else shm_gather.transport(self.comm_group, params, device)
        )
        if transport is not None:
            return shm_gather.start(transport, params, tag, self.check)
        return foreach_all_gather(
            params, tag, codec, self.ranks, self.pool, self.check, self.host_reads.note
        )

    def _start_secondary(self, params: list[ShardedParam], label: str) -> InFlightGather:
        crc, _ = self.check.unit(params, params[0].full.dtype, params[0].full.device, staged=False)
        self.check.issued(crc, label, params)
        return self.secondary.start(params)

    def _finish(self, gather: InFlightGather) -> None:
        foreach_all_gather_copy_out(gather, self.check, self.rank)
        if not gather.from_secondary:
            # in a training forward: this rank's piece of each, for the backward's gather
            self.secondary.keep(gather.params)
        self.holds.landed(gather)
        gather.recycle(self.pool)

    # -- ahead of use: prefetch and reuse by the trace ------------------------------------------
    def _prefetch_ahead(self) -> None:
        self.read_ahead.follow(self.trace.upcoming(), self.holds.in_flight)
        if not self.trace.following:
            return
        room = self.max_live - self.holds.held_numel
        in_flight = self.holds.in_flight_numel()
        for label, todo in self.trace.prefetches(in_flight, room, self.holds.in_flight):
            self.order_check.before(todo, label)
            self._start(todo, label)

    def _rest_of_group(self, todo: list[ShardedParam]) -> list[ShardedParam]:
        """The rest of the current gather group, when it fits the live limit beside ``todo``."""
        ids = {id(sp) for sp in todo}
        rest = [sp for sp in self.trace.rest_of_group(self.holds.in_flight) if id(sp) not in ids]
        kind = (todo[0].full.dtype, todo[0].full.device)
        if any((sp.full.dtype, sp.full.device) != kind for sp in rest):
            return []
        size = sum(sp.full.numel() for sp in todo + rest)
        return rest if size <= self.max_live - self.holds.held_numel else []

    def _reused_soon(self, sp: ShardedParam) -> bool:
        return self.trace.reused_soon(sp, self.max_live - self.holds.held_numel)

    # -- host shards read by the device (offload_param) ----------------------------------------
    def host_reads_done(self) -> None:
        """Before the step updates host shards in place (CPU-Adam on offload_param's shards): every
        upload queued from them has finished reading them (one event; nothing to wait for on the
        host itself)."""
        self.host_reads.done()

    # -- the always-on check (fetch_check.FetchCheck) -------------------------------------------
    def boundary_values(self) -> tuple[int, int, Optional[torch.Tensor]]:
        """For the boundary step's all-reduce: the digest's two halves and the device count of bad
        tags."""
        d1, d2 = self.check.halves()
        # on a device the collectives' identity checks are counted there, unread (identity.py)
        unread = identity.pending(self.device)
        if unread is None:
            return d1, d2, self.check.bad
        bad = unread.to(torch.float64)
        return d1, d2, bad if self.check.bad is None else bad + self.check.bad

    def end_forward(self, training: bool) -> None:
        """After a forward outside training: raise if a staged gather came back mixed (one host
        read; a training forward is checked at its boundary step instead)."""
        if training or self.world == 1:
            return
        # every rank saw the mixed rows: all raise together
        if self.check.bad is not None and float(self.check.bad) > 0:
            self.raise_diverged()

    def raise_diverged(self) -> None:
        """Every rank calls this together once the sums show the ranks gathered differently (see
        ``fetch_check.raise_fetches_diverged``)."""
        raise_fetches_diverged(self.check, self.device, self.comm_group, self.world)

    def _position(self) -> str:
        """For a failed collective's report: this rank's latest gather."""
        if not self.check.log:
            return ""
        _, label, params = self.check.log[-1]
        names = ", ".join(sp.name for sp in params)
        return f"latest stage-3 gather {self.check.issued_count}: {label} [{names}]"
