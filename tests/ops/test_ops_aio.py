"""Async file I/O: the compiled pool and the Python-thread fallback move bytes exactly; bad requests are refused."""

import os
import time

import pytest
import torch

from zengine.ops import load_op
from zengine.ops.aio import ALIGN, AsyncIO, IOStats, SwapFile, aligned_empty

KINDS = ["compiled", "threads"]


def _io(kind, block=1 << 16, threads=2):
    if kind == "compiled" and load_op("async_io") is None:
        pytest.skip("the async_io op cannot be built here")
    io = AsyncIO(block, threads, use_kernel=kind == "compiled")
    assert io.compiled == (kind == "compiled")
    return io


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_many_requests_in_flight(tmp_path, kind):
    io = _io(kind)
    f = SwapFile(tmp_path, 8 * (1 << 20))
    assert os.listdir(tmp_path) == []  # unlinked at once: nothing is left behind
    n = (1 << 20) // 4  # 1 MiB per tensor, 16 blocks of 64 KiB each
    sources = [aligned_empty(n).uniform_() for _ in range(6)]
    writes = [
        io.write(t, f, k * (1 << 20)) for k, t in enumerate(sources)
    ]  # all queued before any wait
    for w in writes:
        w.wait()
    back = [aligned_empty(n) for _ in sources]
    reads = [io.read(t, f, k * (1 << 20)) for k, t in enumerate(back)]
    for r in reversed(reads):
        r.wait()
    assert all(torch.equal(a, b) for a, b in zip(sources, back))
    # what the other implementation wrote reads back the same (one file format)
    other = _io("threads" if kind == "compiled" else kind)
    again = aligned_empty(n)
    other.read(again, f, 3 * (1 << 20)).wait()
    assert torch.equal(again, sources[3])
    io.close()
    other.close()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_requests_are_refused_before_any_io(tmp_path, kind):
    io = _io(kind)
    f = SwapFile(tmp_path, 4 * ALIGN)
    with pytest.raises(ValueError, match="outside the 16384-byte swap file"):
        io.read(aligned_empty(2 * ALIGN // 4), f, 3 * ALIGN)
    with pytest.raises(ValueError, match="contiguous CPU"):
        io.write(torch.zeros(4, 4).t(), f, 0)
    if f.direct:
        with pytest.raises(ValueError, match="O_DIRECT needs"):
            io.write(aligned_empty(ALIGN // 4)[1:], f, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_an_io_error_names_the_file(tmp_path, kind):
    io = _io(kind)
    f = SwapFile(tmp_path, ALIGN)
    os.close(f.fd)  # the descriptor is gone: pread fails with EBADF inside the pool
    request = io.read(aligned_empty(ALIGN // 4), f, 0)
    with pytest.raises(OSError, match="swap file") as info:
        request.wait()
    assert info.value.errno == 9
    f.fd = -1


def test_swap_file_reservation_fails_clearly_when_the_disk_cannot_hold_it(tmp_path):
    with pytest.raises(OSError, match="cannot reserve .* MiB for NVMe swap"):
        SwapFile(tmp_path, 1 << 62)


def test_swap_file_in_an_unusable_directory_names_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(
        OSError,
        match="cannot create an NVMe swap file in .*a-file/swap.*nvme_path must name a "
        "writable directory",
    ):
        SwapFile(blocker / "swap", ALIGN)


def _pool(kind, block, threads, priority):
    if kind == "compiled" and load_op("async_io") is None:
        pytest.skip("the async_io op cannot be built here")
    return AsyncIO(block, threads, 1, use_kernel=kind == "compiled", priority=priority)


def test_defaults_move_half_mebibyte_blocks_sixteen_at_a_time_reads_first():
    io = AsyncIO(use_kernel=False)
    assert (io.block_size, io.thread_count, io.priority) == (512 << 10, 16, True)
    io.close()
    assert (
        AsyncIO(1 << 20, 2, 4, use_kernel=False).thread_count
    ) == 8  # thread_count x queue_depth workers


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("priority", [True, False])
def test_round_trip_with_uneven_blocks_and_empty_requests(tmp_path, kind, priority):
    io = _pool(kind, 3 * ALIGN, 3, priority)  # requests of 1..7 blocks, the last one short
    f = SwapFile(tmp_path, 64 * ALIGN)
    sizes = [ALIGN // 4 * k for k in (1, 2, 5, 7, 4)]
    offsets = [0, 4 * ALIGN, 8 * ALIGN, 16 * ALIGN, 32 * ALIGN]
    sources = [aligned_empty(n).uniform_() for n in sizes]
    writes = [io.write(t, f, o) for t, o in zip(sources, offsets)]
    empty = io.write(aligned_empty(0), f, 0)
    empty.wait()
    for w in writes:
        w.wait()
        assert w.done()
    back = [aligned_empty(n) for n in sizes]
    for r in [io.read(t, f, o) for t, o in zip(back, offsets)]:
        r.wait()
    assert all(torch.equal(a, b) for a, b in zip(sources, back))
    io.close()


def _slow_region(tmp_path, kind, n):
    """A swap file whose first ``n`` bytes were written (so reading them back costs real I/O) and a
    one-worker pool with 4 KiB blocks: a request of ``n`` bytes takes thousands of blocks, one after another."""
    f = SwapFile(tmp_path, 2 * n)
    fill = _pool(kind, 1 << 20, 4, True)
    fill.write(aligned_empty(n // 4).fill_(1.0), f, 0).wait()
    fill.close()
    return f, aligned_empty(n // 4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("priority", [True, False])
def test_a_read_overtakes_queued_writes_and_fifo_keeps_order(tmp_path, kind, priority):
    n = 16 << 20  # 4096 blocks of 4 KiB ahead of the read
    f, big = _slow_region(tmp_path, kind, n)
    io = _pool(kind, ALIGN, 1, priority)  # one worker: blocks run strictly one after another
    write = io.write(big, f, n)
    read = io.read(aligned_empty(ALIGN // 4), f, 0)
    read.wait()
    # reads first: the write still has most of its blocks queued; one FIFO: it went first
    assert write.done() is (not priority)
    write.wait()
    io.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_request_waited_for_goes_first(tmp_path, kind):
    n = 16 << 20
    f, big = _slow_region(tmp_path, kind, n)
    io = _pool(kind, ALIGN, 1, True)
    first = io.read(big, f, 0)  # a long read queued first
    second = io.write(
        aligned_empty(ALIGN // 4).zero_(), f, n
    )  # a write behind it (writes come last)
    second.wait()  # the caller is blocked on the write: it goes ahead of the rest of the read
    assert not first.done()
    first.wait()
    io.close()


@pytest.mark.parametrize("kind", KINDS)
def test_stats_count_bytes_requests_and_busy_time(tmp_path, kind):
    io = _pool(kind, 1 << 16, 4, True)
    f = SwapFile(tmp_path, 4 << 20)
    assert io.stats().bytes == 0
    t = time.perf_counter()
    src = aligned_empty((2 << 20) // 4).uniform_()
    io.write(src, f, 0).wait()
    mid = io.stats()
    io.read(aligned_empty((1 << 20) // 4), f, 1 << 20).wait()
    io.read(aligned_empty((1 << 20) // 4), f, 3 << 20).wait()
    wall = time.perf_counter() - t
    end = io.stats()
    assert (mid.bytes_written, mid.bytes_read, mid.writes, mid.reads) == (2 << 20, 0, 1, 0)
    step = end - mid
    assert (step.bytes_read, step.bytes_written, step.reads, step.writes, step.bytes) == (
        2 << 20,
        0,
        2,
        0,
        2 << 20,
    )
    assert step.write_seconds == 0 and 0 < step.read_seconds == pytest.approx(step.busy_seconds)
    assert (
        0 < end.busy_seconds <= wall
        and end.read_seconds + end.write_seconds >= end.busy_seconds * 0.999
    )
    assert end.gbps() == pytest.approx(end.bytes / end.busy_seconds / 1e9)
    assert end.gbps(2.0) == pytest.approx(end.bytes / 2e9)
    io.close()
    assert io.stats() == IOStats()


@pytest.mark.parametrize("kind", KINDS)
def test_close_finishes_queued_requests(tmp_path, kind):
    io = _pool(kind, ALIGN, 2, True)
    f = SwapFile(tmp_path, 1 << 20)
    src = aligned_empty((1 << 20) // 4).uniform_()
    request = io.write(src, f, 0)
    io.close()
    assert request.done()
    request.wait()
    back = aligned_empty(src.numel())
    other = _pool(kind, 1 << 16, 2, True)
    other.read(back, f, 0).wait()
    assert torch.equal(back, src)
    other.close()
    with pytest.raises(ValueError, match="closed"):
        io.read(back, f, 0)
