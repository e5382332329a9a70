"""The checkpoint's parts without a process group: piece arithmetic, tensor files and their checksums, the
streaming torch file writer, and the atomic directory protocol."""

import os

import pytest
import torch
from torch import nn

from zengine.checkpoint.native import atomic, tensorfile
from zengine.checkpoint.errors import CheckpointFileError
from zengine.checkpoint.native.pieces import (
    Piece,
    clip,
    group_pieces,
    overlaps,
    saved_pieces,
    split_pieces,
)
from zengine.checkpoint.native.tensorfile import TensorFileReader, write_tensor_file
from zengine.checkpoint.native.torchfile import TorchFileWriter
from zengine.zero.flat_group import FlatParamGroup
from zengine.zero.stage3.group import ShardedParamGroup
from zengine.zero.stage3.param import ShardedParam

SHAPES = {"a": (5, 3), "b": (7,), "c": (2, 2, 2), "d": (1,)}


def _params():
    torch.manual_seed(0)
    return [(n, nn.Parameter(torch.randn(s))) for n, s in SHAPES.items()]


def _coverage(pieces_by_rank):
    """name -> sorted list of (start, end) over all ranks."""
    out = {}
    for pieces in pieces_by_rank:
        for p in pieces:
            out.setdefault(p.name, []).append((p.start, p.end))
    return {n: sorted(r) for n, r in out.items()}


def _exact_cover(ranges, numel):
    pos = 0
    for start, end in ranges:
        assert start == pos, ranges
        pos = end
    assert pos == numel


@pytest.mark.parametrize("num_shards,world", [(1, 3), (3, 3), (2, 2)])
def test_flat_group_pieces_cover_each_parameter_once(num_shards, world):
    groups = [
        FlatParamGroup(_params(), {}, num_shards, rank, torch.float32, torch.device("cpu"))
        for rank in range(world)
    ]
    for g in groups:  # each piece sits where the flat buffer holds those elements
        for p in group_pieces(g):
            span = next(s for s in g.layout.spans if s.name == p.name)
            assert span.offset + p.start == g.owned[0] + p.offset
    cover = _coverage(saved_pieces(g, world) for g in groups)
    for name, shape in SHAPES.items():
        _exact_cover(cover[name], torch.Size(shape).numel())


def test_stage3_group_pieces_cover_each_parameter_once():
    world = 3
    groups = []
    for rank in range(world):
        sharded = [ShardedParam(n, p, world, rank) for n, p in _params()]
        groups.append(
            ShardedParamGroup(sharded, {}, torch.float32, torch.device("cpu"), lambda sps: None)
        )
    for g in groups:
        for p in group_pieces(g):
            sp = next(s for s in g.sharded if s.name == p.name)
            assert torch.equal(
                g.shard_flat[p.offset : p.offset + p.numel], sp.full[p.start : p.end]
            )
    cover = _coverage(saved_pieces(g, world) for g in groups)
    for name, shape in SHAPES.items():
        _exact_cover(cover[name], torch.Size(shape).numel())


def test_piece_arithmetic():
    assert clip([Piece("w", 10, 20, 5)], 8, 12) == [Piece("w", 13, 17, 8)]
    assert clip([Piece("w", 10, 20, 5)], 15, 30) == []
    # saved by two ranks as [0, 6) and [6, 10); the new piece wants [4, 9)
    assert list(overlaps(Piece("w", 4, 9, 0), [[0, 0, 6], [1, 6, 10]])) == [
        (0, 4, 6, 0),
        (1, 0, 3, 2),
    ]
    _exact_cover(
        _coverage(split_pieces(["x", "y"], [(3, 3), (4,)], r, 4) for r in range(4))["x"], 9
    )


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(tensorfile, "BLOCK", 64)
    monkeypatch.setattr(tensorfile, "CHUNK", 256)


def test_tensor_file_round_trip_and_ranges(tmp_path, small_blocks):
    tensors = {
        "big": torch.arange(1000, dtype=torch.float32),
        "half": torch.randn(9, 3).bfloat16(),
        "ints": torch.arange(5),
        "empty": torch.zeros(0),
        "flag": torch.tensor([True, False]),
    }
    path = str(tmp_path / "t.safetensors")
    info = write_tensor_file(path, tensors.items(), {"pieces": {"big": [0, 1000]}})
    reader = TensorFileReader(path, info)
    assert reader.metadata == {"pieces": {"big": [0, 1000]}}
    for k, t in tensors.items():
        assert torch.equal(reader.read(k), t), k
    part = torch.empty(
        300, dtype=torch.float64
    )  # a range across blocks and chunks, cast on the way
    reader.read_into("big", 123, 423, part)
    assert torch.equal(part, torch.arange(123, 423, dtype=torch.float64))
    part = torch.empty(
        970
    )  # the same dtype: whole blocks straight into the destination, the ends apart
    reader.read_into("big", 20, 990, part)
    assert torch.equal(part, torch.arange(20, 990, dtype=torch.float32))
    reader.close()


def test_tensor_file_refuses_corruption(tmp_path, small_blocks):
    path = str(tmp_path / "t.safetensors")
    info = write_tensor_file(path, [("big", torch.arange(1000, dtype=torch.float32))])
    reader = TensorFileReader(path, info)
    with open(path, "r+b") as f:  # one byte in the third block of the data
        f.seek(reader._data_start + 2 * 64 + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    reader.read_into("big", 0, 32, torch.empty(32))  # the first two blocks are intact
    with pytest.raises(
        CheckpointFileError, match="t.safetensors: big fails its checksum at byte 128"
    ):
        reader.read_into("big", 20, 40, torch.empty(20))
    reader.close()
    os.truncate(path, info.size - 4)
    with pytest.raises(CheckpointFileError, match="t.safetensors is .* truncated"):
        TensorFileReader(path, info)
    with pytest.raises(CheckpointFileError, match="t.safetensors is truncated"):
        TensorFileReader(
            path
        )  # without the recorded size: the header says more than the file holds


def test_torch_file_streams_views_and_aliases(tmp_path):
    flat = torch.arange(20, dtype=torch.float32)
    view = flat[5:11].view(2, 3)  # a view into a larger storage: only its own elements are written
    path = str(tmp_path / "m.pt")
    writer = TorchFileWriter(path)
    writer.write("w", view)
    writer.write("h", torch.ones(4, dtype=torch.bfloat16))
    writer.alias("tied", "w")
    writer.close()
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert list(loaded) == ["w", "h", "tied"]
        assert torch.equal(loaded["w"], view) and loaded["h"].dtype == torch.bfloat16
        assert loaded["tied"] is loaded["w"]


def test_publish_replaces_and_latest(tmp_path):
    save_dir = str(tmp_path)
    for value in ("old", "new"):
        staging = atomic.make_staging_dir(save_dir, "t")
        with open(os.path.join(staging, "f"), "w") as f:
            f.write(value)
        atomic.publish(staging, save_dir, "t")
    assert sorted(os.listdir(save_dir)) == ["latest", "t"]
    with open(os.path.join(save_dir, "t", "f")) as f:
        assert f.read() == "new"
    assert atomic.read_latest(save_dir) == "t"
    os.rename(
        os.path.join(save_dir, "t"), os.path.join(save_dir, ".trash-t-0000")
    )  # a crash between renames
    assert atomic.resolve(save_dir, "t") == os.path.join(save_dir, ".trash-t-0000")
    assert atomic.resolve(save_dir, "other") is None
