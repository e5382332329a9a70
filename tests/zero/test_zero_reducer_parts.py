"""The gradient reducer's parts on their own, without a process group: the flat bucket layout, the
landing of reduced pieces in memory, the bucket buffer pool and the launch-order agreement."""

import pytest
import torch
from torch import nn

from zengine.offload.copies import HostCopies
from zengine.offload.landing import ShardsInMemory
from zengine.zero.bucket_buffers import BucketBuffers
from zengine.zero.bucket_order import LaunchSequence, OrderAgreement
from zengine.zero.flat_buckets import FlatRanges
from zengine.zero.flat_group import FlatParamGroup

SHAPES = [(5,), (7,), (2, 2), (3,)]


def _group(world: int, rank: int) -> FlatParamGroup:
    named = [(f"p{i}", nn.Parameter(torch.zeros(shape))) for i, shape in enumerate(SHAPES)]
    return FlatParamGroup(named, {}, world, rank, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_flat_ranges_give_each_rank_its_shard_once(world, rank):
    group = _group(world, rank)
    layout = FlatRanges([group], bucket_numel=6)
    lo0, hi0 = group.owned
    shard = torch.full((hi0 - lo0,), -1.0)
    for bucket, region in zip(layout.queues[0].buckets, layout.regions(0)):
        reduced = torch.arange(bucket.start, bucket.end, dtype=torch.float32)  # each flat index
        mine = layout.mine(0, bucket, reduced)
        assert (mine is None) == (region is None)
        if region is not None:
            assert (shard[region[0] : region[1]] == -1).all(), "two buckets write one element"
            shard[region[0] : region[1]] = mine
    assert torch.equal(shard, torch.arange(lo0, hi0, dtype=torch.float32))


def test_landing_copies_the_first_piece_and_adds_the_next():
    shard = torch.full((8,), 7.0)  # stale values: zero() must not need a fill
    landing = ShardsInMemory([shard], [[(0, 3), (3, 8)]], HostCopies())
    landing.zero()
    landing.add(0, 0, torch.ones(3))
    landing.add(0, 0, torch.ones(3))
    assert landing.landing_grad(0).tolist() == [2, 2, 2, 0, 0, 0, 0, 0]  # unwritten region zeroed
    assert landing.landing_squares(0, 0, 8) == ([], 12.0)
    landing.zero()
    landing.add(0, 1, torch.full((5,), 3.0))
    assert landing.owned_grad(0).tolist() == [0, 0, 0, 3, 3, 3, 3, 3]


def test_bucket_buffers_reuse_released_storage_but_never_an_adopted_gradient():
    buffers = BucketBuffers(torch.float32, HostCopies())
    first = buffers.get((0, 0), (10,), torch.device("cpu"))
    buffers.release((0, 0))
    second = buffers.get((0, 1), (2, 3), torch.device("cpu"))
    assert second.data_ptr() == first.data_ptr() and second.shape == (2, 3)
    buffers.release((0, 1))
    buffers.adopt((0, 2), torch.zeros(4))
    assert buffers.adopted((0, 2)) and not buffers.adopted((0, 1))
    buffers.release((0, 2))
    assert len(buffers.workspace()) == 1
    buffers.trim(keep=0)
    assert buffers.workspace() == []


@pytest.mark.parametrize("agreed", [True, False])
def test_order_agreement_adopts_the_recorded_order_only_when_agreed(agreed):
    layout = FlatRanges([_group(1, 0)], bucket_numel=6)
    sequence = LaunchSequence(layout.queues)
    agreement = OrderAgreement(sequence)
    default = list(sequence.order)
    assert len(default) > 2 and agreement.digests() == (0, 0)
    for pi in range(len(SHAPES)):  # registration order: the reverse of the default's
        sequence.mark_ready(0, pi)
    sequence.finish(lambda gi, bucket: None)
    agreement.backward_done(synced=True)
    recorded = sequence.recorded_order()
    assert recorded != default and agreement.digests() != (0, 0)
    agreement.settle(agreed)
    assert sequence.order == (recorded if agreed else default)
    assert agreement.digests() == (0, 0)
