"""The order of stage 3's gathers: recorded at the first training step, followed to gather ahead of
use.

The first step records the sequence of fetches (the trace). Later steps follow it: after fetching
unit k, the next units are gathered asynchronously, up to ``stage3_prefetch_bucket_size`` elements
ahead and never beyond ``stage3_max_live_parameters`` gathered elements.

Gather groups (``stage3_gather_units: "auto"``, the default): at DeepSpeed's defaults each module
gathers its own parameters, so a transformer block costs one collective per linear layer (on a small
GPT 3.4x the collectives of one unit per block; on an H100, 0.76x FSDP2's step). Once the trace is
recorded, consecutive units are coalesced into groups of at most ``stage3_prefetch_bucket_size``
elements (the memory the user already allows ahead of use), and each group travels as one
collective: the fetch that opens a group gathers the rest of it with its own unit, and prefetch
starts whole groups. ``"module"`` keeps one collective per unit (DeepSpeed's behaviour). Leaf modules
(``leaf.py``) stay single units inside a group; the order and the parameters are the trace's. A parameter released after
forward is kept when the trace says it is fetched again within ``stage3_max_reuse_distance``
elements (and the live limit allows). When a step departs from the trace (a dynamic model), prefetch
stops for the rest of the step and fetching is on demand; this is logged once. With
``offload_param`` on NVMe the shards the trace gathers next are read ahead from the swap file too
(``SwapReadAhead``).

Debug (``stage3_debug_fetch_order``, ``DebugOrderCheck``): before each fetch the ranks compare a
hash of what they are about to gather; if they differ, every rank raises an error naming the fetch
on each rank, instead of hanging in the collective.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch

from ...distributed import collectives
from .fetch_check import FetchOrderError, exchange_labels
from .param import ParamState, ShardedParam

logger = logging.getLogger("zengine")

Key = tuple[str, tuple[int, ...]]  # a fetch: its tag and the ids of its parameters
Unit = tuple[Key, list[ShardedParam]]


class Trace:
    """The first training step's sequence of fetches, and where the step that follows it stands."""

    def __init__(self, prefetch_numel: int, max_reuse: int, rank: int, coalesce: bool = True):
        self.prefetch_numel, self.max_reuse, self.rank = prefetch_numel, max_reuse, rank
        self.coalesce = coalesce  # stage3_gather_units "auto": consecutive units gathered as groups
        self.units: Optional[list[Unit]] = None  # recorded on the first training step
        self.group_end: list[int] = []  # per unit: the index one past the last unit of its group
        self.block_of: Callable[[str], Optional[str]] = lambda tag: None  # (blocks.py)
        self._recording: list[Unit] = []
        self._record = False
        self.pos = 0  # the next unit of ``units`` the step should fetch
        self.following = False  # a training step that has matched the trace so far
        self.invalid = False  # dropped by invalidate(): the next training step records anew
        self._warned_dynamic = False

    def begin_step(self, training: bool) -> None:
        """A forward starts. Training steps record (first) or follow the trace; others fetch on
        demand."""
        self.pos = 0
        self._recording = []
        self._record = training and self.units is None
        self.following = training and self.units is not None
        self.invalid = self.invalid and not self._record

    def end_step(self) -> None:
        """Backward is over: keep the first step's sequence as the trace."""
        if self._record and self._recording:
            self.units = self._recording
            cap = self.prefetch_numel if self.coalesce else 0
            self.group_end = gather_groups(self.units, cap, self.block_of)
        self._recording = []
        self._record = self.following = False

    def invalidate(self) -> None:
        """Forget the recorded order (the model's hooks were replaced: the order may have changed);
        the rest of this step fetches on demand and the next training step records again."""
        self.units, self.group_end = None, []
        self._recording, self._record, self.following = [], False, False
        self.invalid = True

    def note(self, params: Sequence[ShardedParam], tag: str) -> None:
        """A fetch: record it, or check it against the trace (a departure ends following)."""
        key = (tag, tuple(id(sp) for sp in params))
        if self._record:
            self._recording.append((key, list(params)))
            return
        if not self.following:
            return
        if self.pos < len(self.units) and self.units[self.pos][0] == key:
            self.pos += 1
            return
        self.following = False
        if not self._warned_dynamic:
            self._warned_dynamic = True
            if self.rank == 0:
                logger.info(
                    "stage 3: module order changed from the recorded trace at %r; "
                    "fetching on demand",
                    tag,
                )

    def upcoming(self) -> list[Unit]:
        """The units the trace fetches next (none when the step does not follow it)."""
        return self.units[self.pos :] if self.following else []

    def prefetches(
        self, in_flight_numel: int, room: int, in_flight: Callable[[ShardedParam], bool]
    ) -> Iterator[tuple[str, list[ShardedParam]]]:
        """The next units to gather ahead, as (label, parameters not yet gathered nor in flight):
        within the prefetch budget less ``in_flight_numel``, and within ``room`` live elements.
        Lazy: each is started before the next is looked at."""
        if not self.following or self.prefetch_numel <= 0:
            return
        budget = self.prefetch_numel - in_flight_numel
        start = self.pos
        while start < len(self.units):
            if budget <= 0:
                return
            end = self.group_end[start]
            todo = _to_gather(self.units[start:end], in_flight)
            label = _group_label(self.units, start, end)
            partly_whole = self.coalesce and _any_whole(self.units[start:end], in_flight)
            start = end
            if not todo:
                continue
            if partly_whole:  # its modules are still running or releasing: gather it whole later
                return
            size = sum(sp.full.numel() for sp in todo)
            if size > budget or size > room:
                return
            yield label + " (prefetch)", todo
            budget -= size
            room -= size

    def rest_of_group(self, in_flight: Callable[[ShardedParam], bool]) -> list[ShardedParam]:
        """The parameters still to gather of the units after the one just fetched, up to the end of
        its group: the fetch that opens a group gathers them with its own (none when not following
        or when units are not coalesced)."""
        if not self.following or self.pos == 0 or self.pos >= len(self.units):
            return []
        return _to_gather(self.units[self.pos : self.group_end[self.pos - 1]], in_flight)

    def reused_soon(self, sp: ShardedParam, room: int) -> bool:
        """True when the trace fetches ``sp`` again within max_reuse_distance elements, and keeping
        it still leaves ``room`` (live elements) for the next unit to be fetched."""
        if not self.following or self.max_reuse <= 0:
            return False
        upcoming = self.upcoming()
        next_size = (
            sum(p.full.numel() for p in upcoming[0][1] if p.state is ParamState.SHARDED)
            if upcoming
            else 0
        )
        if next_size > room:
            return False
        distance = 0
        for _, params in upcoming:
            if any(p is sp for p in params):
                return distance <= self.max_reuse
            distance += sum(p.numel for p in params)
            if distance > self.max_reuse:
                return False
        return False


# -- gather groups: consecutive units that travel as one collective -------------------------------
def _unit_numel(params: Sequence[ShardedParam]) -> int:
    """Elements a unit gathers (its parameters that are sharded between uses)."""
    return sum(sp.numel for sp in params if not sp.persistent)


def _kind(params: Sequence[ShardedParam]) -> Optional[tuple]:
    """What a collective of these parameters must share (one staging buffer): dtype and device."""
    gathered = [sp for sp in params if not sp.persistent]
    if not gathered:
        return None
    kinds = {(sp.full.dtype, sp.full.device) for sp in gathered}
    return kinds.pop() if len(kinds) == 1 else ("mixed",)


def gather_groups(
    units: Sequence[Unit], cap: int, block_of: Callable[[str], Optional[str]] = lambda t: None
) -> list[int]:
    """Per unit, the index one past the end of its group: consecutive units coalesced while they
    lie in the same block (``block_of`` their tags; outside every block counts as one), their
    elements add up to at most ``cap`` and they share dtype and device (``cap`` 0: every unit
    alone). Units that gather nothing (persistent parameters only) join the group they fall in."""
    ends = [0] * len(units)
    start = 0
    while start < len(units):
        end, numel, kind = start + 1, _unit_numel(units[start][1]), _kind(units[start][1])
        block = block_of(units[start][0][0])
        while end < len(units) and cap > 0:
            k = _kind(units[end][1])
            add = _unit_numel(units[end][1])
            if block_of(units[end][0][0]) != block:
                break
            if (k is not None and kind is not None and k != kind) or numel + add > cap:
                break
            kind = kind if k is None else k
            if kind == ("mixed",):
                break
            numel += add
            end += 1
        for i in range(start, end):
            ends[i] = end
        start = end
    return ends


def _to_gather(
    units: Sequence[Unit], in_flight: Callable[[ShardedParam], bool]
) -> list[ShardedParam]:
    """The parameters of ``units`` still sharded and not being gathered, each once, in order."""
    seen: dict[int, ShardedParam] = {}
    for _, params in units:
        for sp in params:
            if sp.state is ParamState.SHARDED and not in_flight(sp):
                seen.setdefault(id(sp), sp)
    return list(seen.values())


def _any_whole(units: Sequence[Unit], in_flight: Callable[[ShardedParam], bool]) -> bool:
    """Whether any parameter the units gather is whole or being gathered now."""
    return any(
        not sp.persistent and (sp.state is not ParamState.SHARDED or in_flight(sp))
        for _, params in units
        for sp in params
    )


def _group_label(units: Sequence[Unit], start: int, end: int) -> str:
    """A group's name in reports: its first unit's tag and how many more it holds."""
    tag = units[start][0][0]
    return tag if end - start == 1 else f"{tag} +{end - start - 1} units"


# -- the debug check of the order (stage3_debug_fetch_order) --------------------------------------
class OrderCheck(Protocol):
    """Checks, before a fetch, that every rank is about to gather the same parameters."""

    def begin_step(self) -> None:
        """A forward starts: count fetches from one."""
        ...

    def before(self, params: list[ShardedParam], tag: str) -> None:
        """Every rank calls this before gathering ``params``; raises when the ranks differ."""
        ...


class NoOrderCheck:
    """No check (the default): the always-on ``FetchCheck`` names a divergence at the boundary."""

    def begin_step(self) -> None:
        """Nothing to count."""

    def before(self, params: list[ShardedParam], tag: str) -> None:
        """Nothing to compare."""


class DebugOrderCheck:
    """stage3_debug_fetch_order: before each fetch the ranks compare what they will gather."""

    def __init__(self, device: torch.device, group: Any, rank: int, world: int):
        self.device, self.group, self.rank, self.world = device, group, rank, world
        self._seq = 0

    def begin_step(self) -> None:
        """A forward starts: count fetches from one."""
        self._seq = 0

    def before(self, params: list[ShardedParam], tag: str) -> None:
        """One small all-gather of a hash of the fetch; on a difference, every rank's label and the
        error."""
        self._seq += 1
        label = f"#{self._seq} {tag} [{', '.join(sp.name for sp in params)}]"
        digest = torch.tensor([zlib.crc32(label.encode())], dtype=torch.int64).to(self.device)
        # a debug mode: a host read is fine
        everyone = collectives.all_gather_small(digest, self.group).view(-1).tolist()
        if any(d != everyone[self.rank] for d in everyone):
            labels = exchange_labels(label, self.device, self.group, self.world)
            lines = "\n".join(f"  rank {r}: {lab}" for r, lab in enumerate(labels))
            raise FetchOrderError(
                f"stage 3: ranks diverged at parameter fetch {self._seq}; each rank was about "
                f"to gather:\n{lines}\nThe ranks ran different modules (data-dependent control "
                f"flow?); every rank must run the same modules in the same order."
            )


def order_check(
    zero_cfg: Any, device: torch.device, group: Any, rank: int, world: int
) -> OrderCheck:
    """``DebugOrderCheck`` when ``stage3_debug_fetch_order`` asks for it, else ``NoOrderCheck``."""
    if getattr(zero_cfg, "stage3_debug_fetch_order", False):
        return DebugOrderCheck(device, group, rank, world)
    return NoOrderCheck()


# -- reads ahead from the parameter swap file (offload_param nvme) --------------------------------
class ReadAhead(Protocol):
    """Where the shards of the next gathers are read from ahead of them: the parameters' home."""

    def begin_step(self) -> None:
        """A forward starts: check the home is intact."""
        ...

    def follow(self, upcoming: list[Unit], in_flight: Callable[[ShardedParam], bool]) -> None:
        """Start reading the shards of the ``upcoming`` units, as far as the buffers go."""
        ...

    def forget(self) -> None:
        """Drop what was read ahead (the step is about to write new shards)."""
        ...


class NoReadAhead:
    """Shards in memory (no swap file): nothing to read ahead."""

    def begin_step(self) -> None:
        """Nothing to check."""

    def follow(self, upcoming: list[Unit], in_flight: Callable[[ShardedParam], bool]) -> None:
        """Nothing to read."""

    def forget(self) -> None:
        """Nothing read."""


class SwapReadAhead:
    """Shards in a parameter swap file (``offload.param_swap.ParamSwap``): read them ahead of the
    gathers."""

    def __init__(self, swap: Any):
        self.swap = swap

    def begin_step(self) -> None:
        """Raise, naming the file, when it lost its contents."""
        self.swap.check()

    def follow(self, upcoming: list[Unit], in_flight: Callable[[ShardedParam], bool]) -> None:
        """Start reading the swap file's shards the trace gathers next, as far as its buffers go."""
        for _, params in upcoming:
            todo = [
                sp
                for sp in params
                if sp.state is ParamState.SHARDED
                and sp.shard is None
                and sp.swap_file is self.swap
                and not in_flight(sp)
            ]
            if todo and not self.swap.prefetch(todo):
                return

    def forget(self) -> None:
        """Shards read ahead are stale once the step writes new ones."""
        self.swap.forget_prefetched()


def read_ahead_for(swap: Any) -> ReadAhead:
    """The read-ahead for a parameter home with ``swap`` (its ``ParamSwap``, or None: in memory)."""
    return NoReadAhead() if swap is None else SwapReadAhead(swap)
