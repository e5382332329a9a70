"""Stage 3 with the optimizer on a device: each param group cut into the gradient buckets
(``zero/sub_groups.py`` ``bucket_sub_groups``), so that a group's gradient shard is made when its
bucket's reduction lands and the shards grow as backward goes (FSDP2's order), not all at the first
reduction while every activation is held. CI has no such device, so the cut and the dropped shards are
made on the host here (``device_guard.caching_allocator_on_host``): the run matches the single-process torch reference, each
group is one bucket, the user sees their own two param groups (their ``lr``), and a checkpoint written
cut loads into an uncut run and back, every state equal. The memory side is counted on the stand-in
device (``test_zero3_device_memory.py``)."""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist

from checkpoint.checkpoint_runs import GLOBAL_BATCH, batches, config, make_engine, train
from device_guard import caching_allocator_on_host
from harness import spawn
from models import micro_batch, whole_states
from zero.test_zero_parity import check_parity


def _parity(precision: str, gas: int):
    with caching_allocator_on_host():
        return check_parity(3, precision, gas)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("precision,gas", [("fp32", 1), ("fp32", 3), ("bf16", 2)])
def test_bucket_units_match_torch(world, precision, gas):
    for off in spawn(_parity, world, precision, gas):  # (asserted inside, per rank)
        assert off is not None


def _units(world: int):
    with caching_allocator_on_host():
        engine = make_engine(config(3), seed=0)
        opt = engine.optimizer
        buckets = [len(q.buckets) for q in opt.grads.layout.queues]
        owners = list(opt.group_map.owner)
        lrs = [g["lr"] for g in opt.optimizer.param_groups]
        train(engine, batches(1))
        x, y = micro_batch(batches(1)[0], dist.get_rank(), world, GLOBAL_BATCH // world, 0)
        engine.backward(engine(x, y))
        held = [t.numel() for t in opt.grads.landing.tensors()]
        engine.step()  # (zeroes the gradients)
        dropped = len(opt.grads.landing.tensors())
    return buckets, owners, lrs, held, [g.shard_numel for g in opt.groups], dropped


@pytest.mark.parametrize("world", [1, 2])
def test_groups_are_the_buckets_and_the_param_groups_the_users(world):
    for buckets, owners, lrs, held, shards, dropped in spawn(_units, world, world):
        assert len(buckets) > 4 and buckets == [1] * len(buckets), buckets
        assert sorted(set(owners)) == [0, 1] and owners == sorted(owners), owners
        assert lrs == [pytest.approx(1e-2), pytest.approx(2e-2)], lrs  # edge_param_groups' own
        assert held == shards  # after backward every group's shard is made, each its own size
        assert dropped == 0  # and dropped at zero_grad


def _resume(path: str, writer_cut: bool, reader_cut: bool):
    """Train 2 steps (cut or not), save, load into a run cut or not, train 2 more; and the writer
    the same 2 more. Returns (states after loading, states the writer had), the same after the
    2 steps, their losses, the groups of each."""

    def cut(yes: bool):
        return caching_allocator_on_host() if yes else contextlib.nullcontext()

    data = batches(4)
    with cut(writer_cut):
        writer = make_engine(config(3), seed=0)
        train(writer, data[:2])
        writer.save_checkpoint(path, tag="t")
        written = whole_states(writer)
        groups = [len(writer.optimizer.groups)]
        more = train(writer, data[2:])
        after_writer = whole_states(writer)
    dist.barrier()
    with cut(reader_cut):
        reader = make_engine(config(3), seed=1)
        reader.load_checkpoint(path, tag="t")
        loaded = whole_states(reader)
        groups.append(len(reader.optimizer.groups))
        more_reader = train(reader, data[2:])
        after_reader = whole_states(reader)
    return (loaded, written), (after_reader, after_writer), (more_reader, more), groups


@pytest.mark.parametrize("writer_cut,reader_cut", [(True, False), (False, True), (True, True)])
def test_checkpoint_crosses_the_cut(tmp_path, writer_cut, reader_cut):
    for (loaded, written), (after_r, after_w), (more_r, more_w), groups in spawn(
        _resume, 2, str(tmp_path / "ckpt"), writer_cut, reader_cut
    ):
        # uncut: the two param groups; cut: the buckets
        assert groups == [6 if writer_cut else 2, 6 if reader_cut else 2], groups
        assert loaded == written  # masters, moments, parameters: the same values
        # the steps after it alike (a fused optimizer's step counts are one tensor each)
        assert more_r == pytest.approx(more_w, rel=1e-6)
        for name, value in after_w.items():
            assert after_r[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
