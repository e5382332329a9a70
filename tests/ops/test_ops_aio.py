"""Async file I/O: the compiled pool and the Python-thread fallback move bytes exactly; bad requests are refused."""
import os

import pytest
import torch

from zengine.ops import load_op
from zengine.ops.aio import ALIGN, AsyncIO, SwapFile, aligned_empty

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
    writes = [io.write(t, f, k * (1 << 20)) for k, t in enumerate(sources)]  # all queued before any wait
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
    with pytest.raises(OSError, match="cannot create an NVMe swap file in .*a-file/swap.*nvme_path must name a "
                                      "writable directory"):
        SwapFile(blocker / "swap", ALIGN)
