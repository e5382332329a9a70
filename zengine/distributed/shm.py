"""Collectives through shared memory for the ranks of a gloo group that all run on one host.

On gloo every byte of a collective crosses the loopback TCP stack: copied into the kernel by the
sender, out of it by the receiver, with the stack's work around it, all on the cores that also
compute. Ranks on one host can instead see each other's data: each writes its part into a segment
of shared memory that every rank has mapped, one small gloo all-reduce marks that all have written
(the sync), and each reads what it needs straight from the others' parts. Measured on the 2-core box
(84 MiB, 2 ranks): an all-gather by rows 14 ms of CPU against gloo's 27 ms, an all-reduce 28 ms
against 53 ms (``benchmarks/bench_shm.py``).

The segment holds two slots of ``world x piece_bytes``; a collective moves its buffer a piece at a
time, alternating slots, one sync per piece. Alternating makes one sync enough: a rank writes slot s
for piece k only after the sync of piece k-1, which every rank entered after reading piece k-2, the
slot's previous use. Every rank must call the same collectives in the same order (as for any
collective); the pieces follow from the shapes, which agree.

Sums are taken in rank order (``out = part 0 + part 1 + ...``), the same on every rank, so every rank
holds the same bits (with 2 ranks exactly gloo's sums). The segment is unlinked as soon as every rank
has mapped it: nothing is left in ``/dev/shm`` if a rank dies.

``install(group, piece_bytes)`` (every rank of the group, together) sets a group's transport up when
all its ranks share this host (the engine calls it through ``install_for``, as the ``shared_memory``
config section says: by default wherever it applies); ``collectives.py`` asks ``for_group`` before
each all-gather by rows, all-reduce, reduce-scatter of rows and reduction to owners, and uses it for CPU
tensors of at least ``MIN_BYTES``.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
import zlib
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from . import identity

if TYPE_CHECKING:  # annotations only
    from ..config.shared_memory import SharedMemoryConfig  # config is a layer above

logger = logging.getLogger("zengine")

MIN_BYTES = (
    64 * 1024
)  # below this gloo's latency is as low as a sync's, and the pieces' bookkeeping is not worth it
# "auto" sets up no segment whose pieces would be smaller: measured (bench_shm.py --piece, W=2, 16-84 MiB), 1 MiB
# pieces cost 1.2-1.9x less CPU than gloo, 256 KiB ones 1.3-2x more (a sync per piece)
MIN_AUTO_PIECE = 2**20
# "auto" takes at most this share of the room left in /dev/shm (others use it too: DataLoader workers' tensors)
AUTO_ROOM_SHARE = 0.25
_DIR = "/dev/shm"


# the check's names, where this module's callers knew them (identity.py is the check)
CollectiveMismatchError = identity.CollectiveMismatchError
_identity = identity.identity


class SharedMemoryTransport:
    """One group's segment and the collectives over it (see the module doc)."""

    def __init__(self, group, rank: int, world: int, piece_bytes: int):
        self.group, self.rank, self.world = group, rank, world
        self.piece_bytes = max(
            64, int(piece_bytes) // 64 * 64
        )  # whole elements of any dtype, aligned slots
        self.users = 0  # engines using it (install/uninstall)
        self._slot = 0  # the slot the next piece uses
        # the sync's [identity, -identity] (identity.py)
        self._flag = torch.zeros(2, dtype=torch.int64)
        self.segment = self._map(
            2 * world * self.piece_bytes
        )  # [2 slots x world x piece_bytes] bytes

    def _map(self, nbytes: int) -> torch.Tensor:
        """Every rank maps one new segment of ``nbytes``; rank 0 makes it and unlinks it once all have it.
        Its pages are reserved when it is made (``posix_fallocate``): a full ``/dev/shm`` (a container's
        64 MiB default) is an ``OSError`` here, on every rank, not a SIGBUS at the first write."""
        from . import collectives

        head = torch.zeros(
            17, dtype=torch.uint8
        )  # the name's 16 bytes, then 1 when rank 0 made the file
        path = None
        if self.rank == 0:
            head[:16].copy_(torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8))
            path = os.path.join(_DIR, "zengine-" + bytes(head[:16].tolist()).hex())
            head[16] = _make(path, nbytes)
        collectives.broadcast(head, collectives.global_rank(0, self.group), self.group)
        if not head[16]:
            raise OSError(f"no room for a {nbytes / 2**20:.1f} MiB shared-memory segment in {_DIR}")
        path = os.path.join(_DIR, "zengine-" + bytes(head[:16].tolist()).hex())
        segment, failed = None, torch.zeros(1)
        try:
            segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            failed += 1
        finally:  # every rank has it mapped (or failed): the name can go
            collectives.run_blocking(
                "shared-memory map", failed, dist.all_reduce, failed, group=self.group
            )
            if self.rank == 0:
                os.unlink(path)
        if failed.item():
            raise OSError(f"{int(failed.item())} rank(s) could not map the shared-memory segment")
        return segment

    def _sync(self, what: str, ident: int) -> None:
        """Return once every rank of the group has come here (what each wrote before is visible to all).
        An all-reduce, not a barrier: gloo's barrier would first wait for every collective in flight.
        It is the collectives' identity check (``identity.py``: the MAX all-reduce of
        ``[identity, -identity]``): when the ranks made different collectives (sizes that would
        disagree, which gloo names and shared memory could not see) every rank raises here, at
        this same sync; the check before a collective through gloo is the same all-reduce, so the
        two pair up."""
        from . import collectives

        self._flag[0], self._flag[1] = ident, -ident
        what = f"{what} through shared memory"
        collectives.run_blocking(
            f"{what} (its sync)",
            self._flag,
            collectives._all_reduce_max,
            self._flag,
            group=self.group,
        )
        if not identity.agreed(self._flag):
            raise identity.mismatch(
                what, ident, self.group, lambda row: collectives.exchange_rows(row, self.group)
            )

    def _piece(self, dtype: torch.dtype, width: int) -> torch.Tensor:
        """The next slot as ``[world, width]`` of ``dtype``."""
        slot, self._slot = self._slot, 1 - self._slot
        size = self.world * self.piece_bytes
        return (
            self.segment[slot * size : (slot + 1) * size]
            .view(dtype)[: self.world * width]
            .view(self.world, width)
        )

    def takes(self, t: torch.Tensor) -> bool:
        """Whether a collective of ``t`` goes through shared memory (a CPU tensor, large enough)."""
        return t.device.type == "cpu" and t.numel() * t.element_size() >= MIN_BYTES

    def all_gather_rows(self, rows: torch.Tensor) -> None:
        """Row r of ``rows`` ([world, n], each row contiguous) on every rank from rank r's row r."""
        self.gather_columns([rows[self.rank]], [rows], rows.dtype, own_in_place=True)

    def gather_columns(
        self,
        sources: list[torch.Tensor],
        targets: list[torch.Tensor],
        dtype: torch.dtype,
        own_in_place: bool = False,
    ) -> None:
        """An all-gather of several buffers at once: row r of each target ([world, width_i]) on every rank from
        rank r's source i ([width_i]), the targets' columns taken end to end a piece at a time.
        ``own_in_place``: each source already is this rank's row of its target (not copied back)."""
        widths = [t.shape[1] for t in targets]
        ident = _identity("all_gather", dtype, widths)
        per = max(1, self.piece_bytes // torch.empty(0, dtype=dtype).element_size())
        i, offset = 0, 0  # the target the next piece starts in, and how far into its columns
        while i < len(targets):
            spans, width = [], 0  # (target, its first column, columns, the piece's first column)
            while i < len(targets) and width < per:
                take = min(widths[i] - offset, per - width)
                spans.append((i, offset, take, width))
                width, offset = width + take, offset + take
                if offset == widths[i]:
                    i, offset = i + 1, 0
            piece = self._piece(dtype, width)  # [world, width]
            for t, start, take, col in spans:
                piece[self.rank, col : col + take].copy_(sources[t][start : start + take])
            self._sync("all_gather", ident)
            for t, start, take, col in spans:
                if own_in_place:
                    for r in range(self.world):
                        if r != self.rank:
                            targets[t][r, start : start + take].copy_(piece[r, col : col + take])
                else:
                    targets[t][:, start : start + take].copy_(piece[:, col : col + take])

    def reduce_scatter_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Row ``rank`` of ``rows`` ([world, n], contiguous) summed over the group, in rank order, into that row
        (returned); the other rows are left as they were. Each rank reads only its own row of every part."""
        n = rows.shape[1]
        ident = _identity("reduce_scatter", rows.dtype, rows.shape)
        per = max(
            1, self.piece_bytes // (self.world * rows.element_size())
        )  # a piece: [world, per] of each rank
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            piece = self._piece(rows.dtype, self.world * (hi - lo)).view(
                self.world, self.world, hi - lo
            )
            piece[self.rank].copy_(rows[:, lo:hi])  # [writer, row, hi - lo]
            self._sync("reduce_scatter", ident)
            _rank_order_sum(list(piece[:, self.rank]), rows[self.rank, lo:hi])
        return rows[self.rank]

    def reduce_owned(self, flat: torch.Tensor, owned: list[tuple[int, int]]) -> None:
        """``flat`` (1-d, contiguous) summed over the group, in rank order, within the ``[lo, hi)`` ranges this
        rank owns (``owned``, each rank its own, disjoint); the rest of ``flat`` is left as it was. Each rank
        writes only what the others own and reads only what it owns (stage 2: each rank keeps its shard)."""
        ident = _identity("reduce", flat.dtype, flat.shape)
        per = max(1, self.piece_bytes // flat.element_size())
        for lo in range(0, flat.numel(), per):
            hi = min(flat.numel(), lo + per)
            piece = self._piece(flat.dtype, hi - lo)  # [world, hi - lo]
            mine = [(max(a, lo), min(b, hi)) for a, b in owned if max(a, lo) < min(b, hi)]
            at = lo
            for a, b in mine + [
                (hi, hi)
            ]:  # the columns the others own (this rank's own never leave flat)
                if at < a:
                    piece[self.rank, at - lo : a - lo].copy_(flat[at:a])
                at = max(at, b)
            self._sync("reduce", ident)
            for a, b in mine:
                out = flat[a:b]
                _rank_order_sum(
                    [
                        out if r == self.rank else piece[r, a - lo : b - lo]
                        for r in range(self.world)
                    ],
                    out,
                )

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous) in place over the group, in rank order."""
        flat = tensor.view(-1)
        ident = _identity("all_reduce", tensor.dtype, flat.shape)
        per = max(1, self.piece_bytes // tensor.element_size())
        for lo in range(0, flat.numel(), per):
            hi = min(flat.numel(), lo + per)
            piece = self._piece(tensor.dtype, hi - lo)  # [world, hi - lo]
            piece[self.rank].copy_(flat[lo:hi])
            self._sync("all_reduce", ident)
            _rank_order_sum(list(piece), flat[lo:hi])


def _rank_order_sum(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = parts[0] + parts[1] + ...`` in that order, so that every rank gets the same bits (with two parts
    exactly gloo's sum). ``out`` may be one of the parts: past the first two it is summed apart, then copied."""
    acc = torch.empty_like(out) if any(p is out for p in parts[2:]) else out
    torch.add(parts[0], parts[1], out=acc)
    for p in parts[2:]:
        acc.add_(p)
    if acc is not out:
        out.copy_(acc)


def _room() -> int:
    """Bytes left in ``/dev/shm`` for an unprivileged process (0 where there is none)."""
    try:
        st = os.statvfs(_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _make(path: str, nbytes: int) -> bool:
    """Make the segment's file with every page reserved; False (nothing left behind) if there is no room."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)


_transports: dict[int, SharedMemoryTransport] = {}  # id(group) -> its transport


def _host_id() -> int:
    """This host, as a number every rank on it computes alike (the boot id where Linux has one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f.read().strip()
    except OSError:
        key = socket.gethostname()
    return zlib.crc32(key.encode())


def _key(group) -> int:
    return id(group if group is not None else dist.GroupMember.WORLD)


def model_bytes(model: torch.nn.Module) -> int:
    """What a collective of ``model`` moves per rank at most: its parameters' full elements (a ``zero.Init``
    parameter's ``ds_numel``) at 4 bytes each, or more for a wider dtype (gradients are reduced in fp32)."""
    return sum(
        getattr(p, "ds_numel", p.numel()) * max(4, p.element_size()) for p in model.parameters()
    )


def install_for(group, section: SharedMemoryConfig, nbytes: int) -> Optional[SharedMemoryTransport]:
    """The engine's call: ``group``'s transport as the ``shared_memory`` config section asks, for a model of
    ``nbytes`` (``model_bytes(model)``). true: ``install`` as given. "auto": where it applies, quietly, with
    pieces small enough that the segment (shared by the host's ranks) is at most half the model's bytes, an
    eighth of its fp32 AdamW states; none for a model whose pieces would be under ``MIN_AUTO_PIECE``, nor where
    the segment would take more than ``AUTO_ROOM_SHARE`` of the room left in ``/dev/shm``."""
    if section.enabled is False or not dist.is_initialized():
        return None
    if section.enabled is True:
        return install(group, section.piece_size)
    # under MIN_AUTO_PIECE: more syncs than data, gloo's transport does as well
    return install(
        group,
        min(section.piece_size, nbytes // (4 * dist.get_world_size(group))),
        asked=False,
        least_piece=MIN_AUTO_PIECE,
        room_share=AUTO_ROOM_SHARE,
    )


def install(
    group, piece_bytes: int, asked: bool = True, least_piece: int = 64, room_share: float = 1.0
) -> Optional[SharedMemoryTransport]:
    """Set up (or reuse) ``group``'s transport; every rank of the group calls this together. None (the
    group keeps gloo's own transport) when the group is not gloo, has one rank, or spans hosts, when the
    smallest ``piece_bytes`` a rank asks for is under ``least_piece``, or when the segment would take more
    than ``room_share`` of the room left in ``/dev/shm``: said on rank 0 when ``asked`` (the config's
    explicit true), at debug level otherwise. What each rank sees is gathered first, so that every rank
    decides alike."""
    from . import collectives

    say = logger.info if asked else logger.debug
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    if not collectives.is_gloo(
        group
    ):  # NCCL moves GPU tensors itself (NVLink, P2P): nothing to do here
        if dist.get_rank(group) == 0:
            say(
                "zengine: shared_memory: the %s backend carries its own collectives; shared memory is for gloo (CPU) "
                "ranks only",
                collectives.backend(group),
            )
        return None
    transport = _transports.get(_key(group))
    if transport is None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        host = _host_id() if os.path.isdir(_DIR) else -1 - rank  # no /dev/shm: a host of its own
        seen = collectives.all_gather_small(
            torch.tensor([host, piece_bytes, _room()], dtype=torch.int64), group
        )
        hosts, piece_bytes, room = (
            len(set(seen[:, 0].tolist())),
            int(seen[:, 1].min()),
            int(seen[:, 2].min()),
        )
        if hosts != 1:
            if rank == 0:
                say(
                    "zengine: shared_memory: the ranks are on %d hosts (or one has no %s): gloo's transport stays",
                    hosts,
                    _DIR,
                )
            return None
        if piece_bytes < least_piece:
            return None
        if (
            2 * world * piece_bytes > room_share * room
        ):  # e.g. a container's 64 MiB /dev/shm, which DataLoader
            if rank == 0:  # workers need too
                say(
                    "zengine: shared_memory: a %.1f MiB segment would take more than %.0f%% of the %.1f MiB left in "
                    "%s: gloo's transport stays",
                    2 * world * piece_bytes / 2**20,
                    100 * room_share,
                    room / 2**20,
                    _DIR,
                )
            return None
        try:
            transport = SharedMemoryTransport(
                group if group is not None else dist.GroupMember.WORLD, rank, world, piece_bytes
            )
        except OSError as err:  # every rank got the same error (the map's outcome is agreed)
            if rank == 0:
                (logger.warning if asked else logger.info)(
                    "zengine: shared_memory: %s; gloo's transport stays (free room in %s, or lower "
                    "shared_memory.piece_size)",
                    err,
                    _DIR,
                )
            return None
        _transports[_key(group)] = transport
        if rank == 0:
            say(
                "zengine: shared_memory: collectives of %d ranks through a %.1f MiB segment",
                world,
                transport.segment.numel() / 2**20,
            )
    transport.users += 1
    return transport


def uninstall(transport: Optional[SharedMemoryTransport]) -> None:
    """An engine is done with ``transport``: unmapped once no engine uses it."""
    if transport is None:
        return
    transport.users -= 1
    if transport.users <= 0:
        _transports.pop(_key(transport.group), None)


def for_group(group) -> Optional[SharedMemoryTransport]:
    """The transport installed for ``group``, or None."""
    return _transports.get(_key(group)) if _transports else None
