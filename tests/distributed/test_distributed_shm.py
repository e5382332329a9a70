"""Collectives through shared memory (zengine/distributed/shm.py) give what gloo's give, bit for bit where the
sum has one order, and leave nothing in /dev/shm."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.harness import spawn
from zengine.distributed import collectives, shm

PIECE = 64 * 1024  # bytes: small, so that the buffers below cross several pieces and both slots


def _gaps(ranges: list, n: int) -> list:
    """The ranges of [0, n) outside ``ranges`` (sorted, disjoint)."""
    out, at = [], 0
    for lo, hi in ranges:
        out.append((at, lo))
        at = hi
    return out + [(at, n)]


def _shm_files() -> set:
    return (
        {f for f in os.listdir("/dev/shm") if f.startswith("zengine-")}
        if os.path.isdir("/dev/shm")
        else set()
    )


def _collectives(seed: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    before = len(_shm_files())
    dist.barrier()  # every rank counted before rank 0 makes the segment
    transport = shm.install(None, PIECE)
    dist.barrier()  # (rank 0 unlinks the segment's name as it leaves install)
    out = {"installed": transport is not None, "left_after_install": len(_shm_files()) - before}
    g = torch.Generator().manual_seed(seed + rank)
    cases = []
    for n, dtype in [
        (40_000, torch.float32),
        (16_385, torch.float32),
        (70_001, torch.bfloat16),
        (9, torch.float32),
    ]:
        mine = torch.randn(world, n, generator=g).to(
            dtype
        )  # [world, n]: this rank's rows (only its own is meant)
        cases.append(mine)
    # gloo's own results first (the transport is consulted per call: take it out meanwhile)
    shm._transports.clear()
    expect_rows, expect_sum = [], []
    for mine in cases:
        rows = mine.clone()
        collectives.all_gather_rows(rows, rank)
        expect_rows.append(rows)
        total = mine.clone()
        dist.all_reduce(total)
        expect_sum.append(total)
    shm._transports[id(dist.GroupMember.WORLD)] = transport
    got_rows, got_sum = [], []
    pending = collectives.all_reduce_sum(
        torch.ones(3), async_op=True
    )  # a small gloo one in flight meanwhile
    for mine in cases:
        rows = mine.clone()
        works = collectives.all_gather_rows(rows, rank, async_op=True)
        assert (works == []) == (
            mine.numel() * mine.element_size() >= shm.MIN_BYTES
        )  # shared memory: done already
        for w in works:
            w.wait()
        got_rows.append(rows)
        total = mine.clone()
        collectives.all_reduce_sum(total)
        got_sum.append(total)
    pending.wait()
    scattered = []
    for mine in cases:
        rows = mine.clone()
        works, got = collectives.reduce_scatter_rows(rows, rank)
        for w in works:  # gloo's all-reduce (a small buffer)
            w.wait()
        scattered.append(
            (
                works == [],
                got.clone(),
                torch.equal(rows[torch.arange(world) != rank], mine[torch.arange(world) != rank]),
            )
        )
    owned = []  # reduce_to_owners: the flat buffer cut unevenly among the ranks, a rank owning two pieces
    for mine in cases:
        flat = mine.clone().view(-1)
        n = flat.numel()
        cuts = sorted({0, n, *(n * (2 * k + 1) // (2 * world + 1) for k in range(2 * world))})
        pieces = [(i % world, lo, hi) for i, (lo, hi) in enumerate(zip(cuts, cuts[1:]))]
        works = collectives.reduce_to_owners(flat, pieces, rank)
        for w in works:
            w.wait()
        owned.append((works == [], flat.clone(), [(lo, hi) for o, lo, hi in pieces if o == rank]))
    # the sums by hand in rank order: what every rank must hold
    by_rank = []
    for mine in cases:
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        acc = parts[0] + parts[1] if world > 1 else parts[0].clone()
        for p in parts[2:]:
            acc += p
        by_rank.append(acc)
    shm.uninstall(transport)
    out.update(
        rows_equal=[torch.equal(a, b) for a, b in zip(got_rows, expect_rows)],
        sums_rank_order=[
            torch.equal(a, b)
            for a, b, m in zip(got_sum, by_rank, cases)
            if m.numel() * m.element_size() >= shm.MIN_BYTES
        ],  # (smaller: gloo's order)
        sums_close=[
            torch.allclose(
                a.float(),
                b.float(),
                rtol=2**-6 if a.dtype == torch.bfloat16 else 1e-6,
                atol=2**-4 if a.dtype == torch.bfloat16 else 1e-6,
            )  # bf16: two roundings apart
            for a, b in zip(got_sum, expect_sum)
        ],
        sums_equal_gloo=[torch.equal(a, b) for a, b in zip(got_sum, expect_sum)],
        scattered=[s[0] for s in scattered],  # through shared memory
        scattered_rank_order=[
            torch.equal(s[1], b[rank]) and s[2] for s, b in zip(scattered, by_rank) if s[0]
        ],  # its row summed, the others untouched
        scattered_close=[
            torch.allclose(s[1].float(), b[rank].float(), rtol=2**-6, atol=2**-4)
            for s, b in zip(scattered, by_rank)
        ],  # the small one: gloo's all-reduce
        owned_shared=[o[0] for o in owned],
        owned_rank_order=[
            all(torch.equal(o[1][lo:hi], b.view(-1)[lo:hi]) for lo, hi in o[2])
            and all(torch.equal(o[1][a:z], m.view(-1)[a:z]) for a, z in _gaps(o[2], m.numel()))
            for o, b, m in zip(owned, by_rank, cases)
            if o[0]
        ],  # the rest untouched
        owned_close=[
            all(
                torch.allclose(
                    o[1][lo:hi].float(), b.view(-1)[lo:hi].float(), rtol=2**-6, atol=2**-4
                )
                for lo, hi in o[2]
            )
            for o, b in zip(owned, by_rank)
        ],
        checksum=[float(t.double().sum()) for t in got_sum],
        uninstalled=shm.for_group(None) is None,
    )
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_collectives_equal_gloos(world):
    before = _shm_files()
    results = spawn(_collectives, world, 7)
    for r in results:
        assert r["installed"] and r["left_after_install"] == 0  # unlinked once mapped
        assert all(r["rows_equal"]), r
        assert all(r["sums_rank_order"]), r  # the documented order
        assert all(r["sums_close"]), r
        if world == 2:  # one addition per element: exactly gloo's
            assert all(r["sums_equal_gloo"]), r
        assert r["scattered"] == [True, True, True, False] and all(r["scattered_rank_order"]), r
        assert all(r["scattered_close"]), r
        assert r["owned_shared"] == [True, True, True, False] and all(r["owned_rank_order"]), r
        assert all(r["owned_close"]), r
        assert r["uninstalled"]
    assert all(r["checksum"] == results[0]["checksum"] for r in results)  # every rank the same bits
    assert _shm_files() <= before


def _not_on_one_host():
    import zengine.distributed.shm as mod

    rank = dist.get_rank()
    mod._host_id = lambda: 1000 + rank  # as if each rank ran on its own host
    return shm.install(None, PIECE) is None and shm.for_group(None) is None


def test_ranks_on_different_hosts_keep_gloo():
    assert all(spawn(_not_on_one_host, 2))


def _no_room(which: str):
    import zengine.distributed.shm as mod

    rank = dist.get_rank()
    if which == "make" and rank == 0:
        mod._make = lambda path, nbytes: False  # /dev/shm full: posix_fallocate failed
    if which == "map" and rank == 1:

        def refuse(*args, **kwargs):
            raise RuntimeError("mmap failed")

        mod.torch = type(
            "T",
            (),
            {
                "from_file": staticmethod(refuse),
                "zeros": torch.zeros,
                "frombuffer": torch.frombuffer,
                "uint8": torch.uint8,
                "tensor": torch.tensor,
                "int64": torch.int64,
            },
        )
    before = len(_shm_files())
    dist.barrier()
    got = shm.install(None, PIECE)
    dist.barrier()
    ok = got is None and shm.for_group(None) is None
    rows = torch.full((dist.get_world_size(), 20_000), float(rank))
    collectives.all_gather_rows(rows, rank)  # gloo still carries the collectives
    return (
        ok
        and rows[:, 0].tolist() == list(range(dist.get_world_size()))
        and len(_shm_files()) == before
    )


@pytest.mark.parametrize("which", ["make", "map"])
def test_no_room_for_the_segment_keeps_gloo_on_every_rank(which):
    assert all(spawn(_no_room, 2, which))
