"""Which stage-3 parameters are whole now: the gathers in flight, the forward's holds, the live
count.

A non-persistent parameter is gathered for a unit's forward (one hold per fetch) and released after
it; when the last hold goes, its full storage is freed unless the trace says it is fetched again
soon (``trace.py``). ``live_numel`` counts the gathered elements ``stage3_max_live_parameters``
bounds; a gather in flight already occupies its parameters' storage, so ``held_numel`` counts those
too.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .gather import InFlightGather
from .param import ParamState, ShardedParam


class Holds:
    """The gathers in flight by parameter, the holds on gathered parameters, and the live count."""

    def __init__(self):
        self.live_numel = 0  # elements of non-persistent parameters gathered now
        self.peak_live_numel = 0  # the most gathered or in flight at once
        self._in_flight: dict[int, InFlightGather] = {}  # id(ShardedParam) -> its gather in flight

    # -- gathers in flight ----------------------------------------------------------------------
    def in_flight(self, sp: ShardedParam) -> bool:
        """Whether ``sp`` is being gathered."""
        return id(sp) in self._in_flight

    def gathers_of(self, params: Sequence[ShardedParam]) -> list[InFlightGather]:
        """The gathers in flight of any of ``params``, each once, in the order of ``params``."""
        found = {
            id(self._in_flight[id(sp)]): self._in_flight[id(sp)]
            for sp in params
            if id(sp) in self._in_flight
        }
        return list(found.values())

    def all_in_flight(self) -> list[InFlightGather]:
        """Every gather in flight, each once."""
        return list({id(g): g for g in self._in_flight.values()}.values())

    def track(self, gather: InFlightGather) -> None:
        """``gather`` was started for the step's use (not a re-gather after it)."""
        for sp in gather.params:
            self._in_flight[id(sp)] = gather

    def in_flight_numel(self) -> int:
        """Elements of the parameters being gathered."""
        return sum(sp.full.numel() for g in self.all_in_flight() for sp in g.params)

    @property
    def held_numel(self) -> int:
        """Elements of non-persistent parameters gathered or being gathered."""
        return self.live_numel + self.in_flight_numel()

    def landed(self, gather: InFlightGather) -> None:
        """``gather`` was copied out: its parameters are whole and count as live."""
        for sp in gather.params:
            self._in_flight.pop(id(sp), None)
            if sp.state is ParamState.SHARDED:
                sp.state = ParamState.GATHERED
                if not sp.persistent:
                    self.live_numel += sp.full.numel()
        self.peak_live_numel = max(self.peak_live_numel, self.held_numel)

    # -- holds ----------------------------------------------------------------------------------
    def hold(self, params: Sequence[ShardedParam]) -> None:
        """A fetch for a forward: one more hold on each non-persistent parameter."""
        for sp in params:
            if not sp.persistent:
                sp.holders += 1

    def release(
        self, params: Sequence[ShardedParam], force: bool, kept: Callable[[ShardedParam], bool]
    ) -> None:
        """Drop a hold on each parameter; free it when nobody holds it and ``kept`` does not keep it
        for a fetch soon (``force``: free it whatever its holds)."""
        for sp in params:
            if sp.state is not ParamState.GATHERED or sp.persistent or sp.pinned:
                continue
            sp.holders = 0 if force else max(0, sp.holders - 1)
            if sp.holders == 0 and (force or not kept(sp)):
                sp.free()
                self.live_numel -= sp.full.numel()
