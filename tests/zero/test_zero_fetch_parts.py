"""The parts the stage-3 Fetcher composes, each without a process group: the trace (record, follow,
prefetch within the budget and the live room, reuse), the holds and live count, the staging pool,
the copy-out of a gather's rows (and its tag check), and hpZ's null object."""

import torch
from torch import nn

from zengine.zero.stage3.fetch_check import TAG, FetchCheck
from zengine.zero.stage3.gather import InFlightGather, StagingPool, foreach_all_gather_copy_out
from zengine.zero.stage3.hierarchical import NoSecondaryPartition
from zengine.zero.stage3.holds import Holds
from zengine.zero.stage3.param import ParamState, ShardedParam
from zengine.zero.stage3.trace import Trace

WORLD = 2
_params: list[nn.Parameter] = []  # a ShardedParam holds its parameter weakly: keep them alive


def _sharded(name: str, numel: int) -> ShardedParam:
    _params.append(nn.Parameter(torch.arange(numel, dtype=torch.float32)))
    sp = ShardedParam(name, _params[-1], WORLD, 0)
    sp.free()
    return sp


def _recorded(
    units: list[list[ShardedParam]], prefetch: int = 100, reuse: int = 0, coalesce: bool = False
) -> Trace:
    """A trace recorded over ``units`` (one collective per unit unless ``coalesce``)."""
    trace = Trace(prefetch, reuse, rank=1, coalesce=coalesce)
    trace.begin_step(training=True)
    for i, unit in enumerate(units):
        trace.note(unit, f"u{i}")
    trace.end_step()
    return trace


def test_the_trace_prefetches_what_follows_within_the_budget_and_the_room():
    a, b, c, d = (_sharded(n, 10) for n in "abcd")
    trace = _recorded([[a], [b], [c], [d]], prefetch=25)
    trace.begin_step(training=True)
    trace.note([a], "u0")
    assert [label for label, _ in trace.prefetches(0, 10**9, lambda sp: False)] == [
        "u1 (prefetch)",
        "u2 (prefetch)",
    ]  # 25 elements ahead: two units of 10
    assert [todo for _, todo in trace.prefetches(0, 15, lambda sp: False)] == [[b]]  # room for one
    assert [todo for _, todo in trace.prefetches(0, 10**9, lambda sp: sp is b)] == [[c], [d]]
    trace.note([c], "u2")  # departs from the trace: on demand for the rest of the step
    assert not trace.following and trace.upcoming() == []
    assert list(trace.prefetches(0, 10**9, lambda sp: False)) == []


def test_coalesced_units_prefetch_as_whole_groups():
    a, b, c, d, e = (_sharded(n, 10) for n in "abcde")
    trace = _recorded([[a], [b], [c], [d], [e]], prefetch=25, coalesce=True)
    assert trace.group_end == [2, 2, 4, 4, 5]  # 20 elements a group: two units under the 25
    trace.begin_step(training=True)
    trace.note([a], "u0")
    assert trace.rest_of_group(lambda sp: False) == [b]  # the fetch of a takes b along
    # (were b not taken along) b alone, then c+d would pass the 25-element budget: not started
    assert list(trace.prefetches(0, 10**9, lambda sp: False)) == [("u1 (prefetch)", [b])]
    # b is whole now (a's fetch took it along) and c still is (its module runs): c+d is not
    # gathered in pieces, the walk waits until all of it is sharded
    b.state = c.state = ParamState.GATHERED
    assert [todo for _, todo in trace.prefetches(0, 10**9, lambda sp: False)] == []
    c.state = ParamState.SHARDED
    assert list(trace.prefetches(0, 10**9, lambda sp: False)) == [
        ("u2 +1 units (prefetch)", [c, d])
    ]
    b.state = ParamState.SHARDED


def test_a_released_parameter_is_kept_when_the_trace_fetches_it_again_soon():
    a, b, c = (_sharded(n, 10) for n in "abc")
    trace = _recorded([[a], [b], [a], [c]], reuse=15)
    trace.begin_step(training=True)
    trace.note([a], "u0")
    assert trace.reused_soon(a, room=100)  # b (10 elements) lies between
    assert not trace.reused_soon(a, room=5)  # no room left for b
    assert not trace.reused_soon(c, room=100)  # 30 elements away
    trace.begin_step(training=False)  # outside training: never kept
    assert not trace.reused_soon(a, room=100)


def test_holds_count_live_elements_and_free_at_the_last_release():
    a, b = _sharded("a", 10), _sharded("b", 6)
    holds = Holds()
    gather = InFlightGather([a, b], None, [], [a.chunk, b.chunk], direct=True)
    holds.track(gather)
    assert holds.in_flight(a) and holds.gathers_of([b, a]) == [gather]
    assert holds.held_numel == a.full.numel() + b.full.numel()
    holds.landed(gather)
    assert a.state is ParamState.GATHERED and not holds.in_flight(a)
    assert holds.live_numel == holds.peak_live_numel == 16
    holds.hold([a, b])
    holds.hold([a])
    holds.release([a, b], force=False, kept=lambda sp: False)
    assert a.state is ParamState.GATHERED and b.state is ParamState.SHARDED  # a held twice
    holds.release([a], force=False, kept=lambda sp: True)
    assert a.state is ParamState.GATHERED  # kept for a fetch soon
    holds.release([a], force=True, kept=lambda sp: True)
    assert a.state is ParamState.SHARDED and holds.live_numel == 0


def test_the_staging_pool_reuses_released_storage_that_fits():
    pool = StagingPool()
    first = pool.take(2, 8, torch.float32, torch.device("cpu"))
    pool.give(first)
    again = pool.take(2, 5, torch.float32, torch.device("cpu"))
    assert again.data_ptr() == first.data_ptr() and again.shape == (2, 5)
    pool.give(again)
    assert pool.take(2, 5, torch.float64, torch.device("cpu")).data_ptr() != first.data_ptr()
    pool.clear()
    assert pool.take(2, 5, torch.float32, torch.device("cpu")).data_ptr() != first.data_ptr()


def test_copy_out_lays_every_ranks_columns_into_each_parameter_and_checks_the_tag():
    a, b = _sharded("a", 4), _sharded("b", 6)  # chunks of 2 and 3
    check = FetchCheck(torch.device("cpu"))
    _, tag = check.unit([a, b], torch.float32, torch.device("cpu"), staged=True)
    staging = torch.cat(
        [torch.tensor([[0.0, 1, 10, 11, 12], [2, 3, 13, 14, 15]]), tag.expand(WORLD, TAG)], dim=1
    )
    foreach_all_gather_copy_out(InFlightGather([a, b], staging, [], [2, 3], tag=tag), check, 0)
    assert a.full.tolist() == [0, 1, 2, 3] and b.full.tolist() == [10, 11, 12, 13, 14, 15]
    assert float(check.bad) == 0
    staging[1, -1] += 1  # rank 1's row carries another unit's tag
    foreach_all_gather_copy_out(InFlightGather([a, b], staging, [], [2, 3], tag=tag), check, 0)
    assert float(check.bad) == 1


def test_without_hpz_no_gather_comes_from_secondary_shards():
    a = _sharded("a", 4)
    none = NoSecondaryPartition()
    none.begin(training=True)
    none.keep([a])
    assert not none.ready([a])
