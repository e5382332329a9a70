"""The ``shared_memory`` section (zengine only): collectives through shared memory for ranks on one host.

On gloo (CPU ranks) every collective otherwise crosses the loopback TCP stack, on the cores that also
compute; ranks on one host can read each other's data from one shared segment instead
(``distributed/shm.py``: measured 1.9x less CPU for an all-gather, 1.9x for an all-reduce, at 84 MiB on
2 ranks; compiled stage 3 1.11x compiled DDP's step through gloo, 1.02x through shared memory).

"auto" (the default) uses it wherever it applies, silently: a gloo group whose ranks all run on this host,
with pieces small enough that the segment is at most half the model's fp32 bytes (an eighth of its AdamW
states); a model whose pieces would be under 1 MiB (8 MiB of parameters on 2 ranks) gets none, as there a
sync per piece costs what it saves; nor where the segment would take more than a quarter of the room left
in ``/dev/shm`` (a container's is 64 MiB, which DataLoader workers use too). ``true`` also says, on rank 0, why it does not apply where it does not
(NCCL, ranks on several hosts, no room in ``/dev/shm``); ``false`` keeps gloo's transport.
"""

from __future__ import annotations

from pydantic import Field

from .base import FlagOrAuto, PositiveSize, _Section


class SharedMemoryConfig(_Section):
    """Collectives of CPU ranks on one host through shared memory (see the module doc)."""

    enabled: FlagOrAuto = Field(
        "auto",
        description=(
            "Run the data-parallel group's all-gathers, all-reduces and stage 2-3's gradient reductions of CPU "
            "tensors (64 KiB and more) through a shared-memory segment when the group is gloo and every rank of it "
            "is on this host; the group's other collectives, and every collective of a group that spans hosts, stay "
            "on gloo. \"auto\": wherever that applies, the segment at most half the model's fp32 bytes and a quarter "
            "of the room left in /dev/shm (none where pieces would be under 1 MiB); true: also say why not where it "
            "does not apply; false: never."
        ),
    )
    piece_size: PositiveSize = Field(
        8 * 2**20,
        description=(
            "Bytes each rank moves per step of a collective; the segment is 2 x world x piece_size bytes. Larger "
            "pieces mean fewer syncs, smaller ones less shared memory. With \"auto\" no more than the model's fp32 "
            "bytes / (4 x world)."
        ),
    )
