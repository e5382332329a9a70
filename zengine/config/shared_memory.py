"""The ``shared_memory`` section (zengine only): collectives through shared memory for ranks on one host.

On gloo (CPU ranks) every collective otherwise crosses the loopback TCP stack, on the cores that also
compute; ranks on one host can read each other's data from one shared segment instead
(``distributed/shm.py``: measured 1.9x less CPU for an all-gather, 1.9x for an all-reduce, at 84 MiB on
2 ranks). Off by default: the segment is memory besides the model states (two slots of world x
``piece_size`` bytes per host), and a group whose ranks span hosts keeps gloo's transport anyway.
"""
from __future__ import annotations

from pydantic import Field

from .base import Flag, PositiveSize, _Section


class SharedMemoryConfig(_Section):
    """Collectives of CPU ranks on one host through shared memory (see the module doc)."""

    enabled: Flag = Field(False, description=(
        "Run the data-parallel group's all-gathers and all-reduces of CPU tensors (64 KiB and more) through a "
        "shared-memory segment when every rank of the group is on this host; the group's other collectives, "
        "and every collective of a group that spans hosts, stay on gloo."))
    piece_size: PositiveSize = Field(8 * 2 ** 20, description=(
        "Bytes each rank moves per step of a collective; the segment is 2 x world x piece_size bytes. Larger "
        "pieces mean fewer syncs, smaller ones less shared memory."))
