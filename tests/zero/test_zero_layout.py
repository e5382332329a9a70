"""Shard arithmetic, without a process group."""

import pytest

from zengine.zero.layout import FlatLayout, chunk_ranges, gradient_buckets, intersect, padded_size


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_tile_the_padded_buffer(world):
    layout = FlatLayout(["a", "b", "c"], [(7, 3), (5,), (11, 2)], world)
    assert layout.numel == 21 + 5 + 22
    assert layout.padded_numel % world == 0 and layout.padded_numel - layout.numel < world
    ranges = [layout.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_records_cover_every_element_once(world):
    layout = FlatLayout(["a", "b", "c"], [(7, 3), (5,), (11, 2)], world)
    covered = {n: [] for n in "abc"}
    for r in range(world):
        for rec in layout.shard_records(r):
            covered[rec.name].append((rec.param_start, rec.param_end))
            span = next(s for s in layout.spans if s.name == rec.name)
            # the record maps shard offsets back to the same flat position
            assert layout.shard_range(r)[0] + rec.shard_offset == span.offset + rec.param_start
    for name, numel in zip("abc", (21, 5, 22)):
        pieces = sorted(covered[name])
        assert pieces[0][0] == 0 and pieces[-1][1] == numel
        assert all(x[1] == y[0] for x, y in zip(pieces, pieces[1:]))


def test_buckets_are_contiguous_reverse_runs_of_whole_params():
    layout = FlatLayout(list("abcde"), [(4,), (4,), (10,), (3,), (3,)], 3)
    buckets = gradient_buckets(layout, 8)
    assert [b.params for b in buckets] == [(3, 4), (2,), (0, 1)]
    assert buckets[0].end == layout.padded_numel  # first bucket takes the padding tail
    covered = sorted((b.start, b.end) for b in buckets)
    assert covered[0][0] == 0 and all(x[1] == y[0] for x, y in zip(covered, covered[1:]))


def test_owner_ranges_and_helpers():
    layout = FlatLayout(["a"], [(10,)], 4)  # padded 12, shard 3
    assert layout.owner_ranges((2, 8)) == [(0, 2, 3), (1, 3, 6), (2, 6, 8)]
    assert intersect((0, 3), (3, 5)) is None and intersect((0, 4), (3, 5)) == (3, 4)
    assert padded_size(0, 3) == 3 and padded_size(10, 4) == 12
    assert chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
