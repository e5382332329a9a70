"""NVMe offload of Adam's moments: SwappedAdam steps exactly as CPUAdam while host memory holds only its
buffers; the file holds the moments; checkpoints see them; unused ranges keep theirs."""

import os
import struct
import tempfile

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet
from zengine.ops import CPUAdam
from zengine.ops.aio import AsyncIO
from zengine.ops.shard_optimizer import ShardPiece
from zengine.offload.state_swap import StateSwapper
from zengine.offload.swapped_adam import SwappedAdam

SIZES = [5000, 1, 3071, 12000]  # chunks of 1024: tails, a one-element parameter, many chunks each
HYPER = dict(
    lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adamw_mode=True, bias_correction=True
)


def _pair(tmp_path, buffer_count, chunk=1024):
    torch.manual_seed(0)
    ref = [torch.randn(n) for n in SIZES]
    mine = [p.clone() for p in ref]
    plain = CPUAdam([{"params": ref[:2]}, {"params": ref[2:], "lr": 3e-3}], **HYPER)
    swapped = SwappedAdam.replacing(
        CPUAdam([{"params": mine[:2]}, {"params": mine[2:], "lr": 3e-3}], **HYPER),
        StateSwapper(SIZES, str(tmp_path), chunk, buffer_count, AsyncIO(1 << 14, 2)),
    )
    return ref, mine, plain, swapped


def _grads(params_a, params_b, seed):
    torch.manual_seed(seed)
    for a, b in zip(params_a, params_b):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()


@pytest.mark.parametrize("buffer_count", [2, 3, 5])
def test_swapped_adam_equals_cpu_adam_bit_for_bit(tmp_path, buffer_count):
    ref, mine, plain, swapped = _pair(tmp_path, buffer_count)
    outs = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
    for step in range(8):
        _grads(ref, mine, step)
        if step == 3:  # a parameter without a gradient is skipped, as CPUAdam skips it
            ref[1].grad = mine[1].grad = None
        plain.step()
        swapped.step_with_copy(dict(zip(mine, outs)))
    assert all(torch.equal(a, b) for a, b in zip(ref, mine))
    assert all(
        torch.equal(o, p.to(torch.bfloat16)) for o, p in zip(outs, mine)
    )  # written in the same pass
    # host memory: the buffers only, not the 2 x 4 bytes per element of the moments
    held = sum(b.numel() * b.element_size() for b in swapped.host_buffers())
    assert held == buffer_count * 2 * 1024 * 4 < 2 * 4 * sum(SIZES)
    assert all(set(swapped.state[p]) == {"step"} for p in mine)
    with swapped.states_in_memory():
        for a, b in zip(ref, mine):
            assert torch.equal(plain.state[a]["exp_avg"], swapped.state[b]["exp_avg"])
            assert torch.equal(plain.state[a]["exp_avg_sq"], swapped.state[b]["exp_avg_sq"])
            assert int(plain.state[a]["step"]) == int(swapped.state[b]["step"])


def test_the_file_holds_the_moments(tmp_path):
    ref, mine, plain, swapped = _pair(tmp_path, 3)
    for step in range(2):
        _grads(ref, mine, step)
        plain.step()
        swapped.step()
    chunk = swapped.swapper.chunks[3][2]  # the third chunk of the 12000-element parameter
    # read it with plain buffered I/O through a second descriptor (the file is unlinked, and O_DIRECT)
    fd = os.open(f"/proc/self/fd/{swapped.swapper.file.fd}", os.O_RDONLY)
    try:
        raw = os.pread(fd, 2 * chunk.padded * 4, chunk.offset)
    finally:
        os.close(fd)
    values = torch.tensor(struct.unpack(f"{2 * chunk.padded}f", raw))
    n = chunk.hi - chunk.lo
    assert torch.equal(values[:n], plain.state[ref[3]]["exp_avg"][chunk.lo : chunk.hi])
    assert torch.equal(
        values[chunk.padded : chunk.padded + n],
        plain.state[ref[3]]["exp_avg_sq"][chunk.lo : chunk.hi],
    )


def test_changes_made_in_memory_go_back_to_the_file(tmp_path):
    ref, mine, plain, swapped = _pair(tmp_path, 2)
    _grads(ref, mine, 0)
    plain.step()
    swapped.step()
    with swapped.states_in_memory():  # what a checkpoint load does
        for a, b in zip(ref, mine):
            plain.state[a]["exp_avg"].mul_(3.0)
            swapped.state[b]["exp_avg"].mul_(3.0)
    assert all(set(swapped.state[p]) == {"step"} for p in mine)
    _grads(ref, mine, 1)
    plain.step()
    swapped.step()
    assert all(torch.equal(a, b) for a, b in zip(ref, mine))


def test_kept_ranges_keep_their_moments(tmp_path):
    ref, mine, plain, swapped = _pair(tmp_path, 3)
    _grads(ref, mine, 0)
    swapped.step()
    with swapped.states_in_memory():
        before = [
            (swapped.state[p]["exp_avg"].clone(), swapped.state[p]["exp_avg_sq"].clone())
            for p in mine
        ]
    _grads(ref, mine, 1)
    n = mine[3].numel()  # elements [1000, 2100) left out of this step: across a chunk boundary
    swapped.step_runs(
        {p: [(0, p.numel(), 2)] for p in mine[:3]} | {mine[3]: [(0, 1000, 2), (2100, n, 2)]}, {}
    )
    with swapped.states_in_memory():
        m, v = swapped.state[mine[3]]["exp_avg"], swapped.state[mine[3]]["exp_avg_sq"]
        assert torch.equal(m[1000:2100], before[3][0][1000:2100]) and torch.equal(
            v[1000:2100], before[3][1][1000:2100]
        )
        assert not torch.equal(m[:1000], before[3][0][:1000])  # the rest moved
    _grads(ref, mine, 2)
    swapped.step()  # the request lasts one step only
    with swapped.states_in_memory():
        assert not torch.equal(
            swapped.state[mine[3]]["exp_avg"][1000:2100], before[3][0][1000:2100]
        )


def test_a_step_in_pieces_in_any_order_equals_the_step_taken_whole(tmp_path):
    """``step_pieces`` over the chunks in a shuffled order, in one swap stream, each between ``begin`` (which
    gives the copy-out target) and ``end``: the bits of CPU-Adam's whole step, runs and all."""
    ref, mine, plain, swapped = _pair(tmp_path, 3)
    outs = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
    ref_outs = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
    streams = []
    stream = swapped.swapper.stream
    swapped.swapper.stream = lambda *a, **k: (streams.append(1), stream(*a, **k))[1]
    target = dict(zip(mine, outs))
    for step in range(1, 4):
        _grads(ref, mine, step)
        n = SIZES[3]  # elements [1000, 2100) of the last parameter left out of step 2
        kept = [(0, 1000, step), (2100, n, step)] if step == 2 else [(0, n, step)]
        runs = [[(0, s, step)] for s in SIZES[:3]] + [kept]
        plain.step_runs(dict(zip(ref, runs)), dict(zip(ref, ref_outs)))
        pieces = [ShardPiece(p, lo, hi) for p in mine for lo, hi in swapped.piece_bounds(p, 1)]
        order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(step))
        pieces = [pieces[i] for i in order]
        log = []

        def begin(piece, log=log):
            log.append(("begin", piece))
            return target[piece.param]

        def end(piece, log=log):
            assert log[-1] == ("begin", piece)  # (nothing between a piece's begin and its end)
            log.append(("end", piece))

        swapped.step_pieces(pieces, dict(zip(mine, runs)), begin, end)
        assert [e[1] for e in log[::2]] == pieces and [e[0] for e in log] == ["begin", "end"] * len(
            pieces
        )
    assert len(pieces) == 5 + 1 + 3 + 12  # its chunks of 1024
    assert len(streams) == 3  # one swap stream a step
    assert all(torch.equal(a, b) for a, b in zip(ref, mine))
    assert all(torch.equal(a, b) for a, b in zip(ref_outs, outs))
    with swapped.states_in_memory():
        for a, b in zip(ref, mine):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(plain.state[a][key], swapped.state[b][key])
            assert int(plain.state[a]["step"]) == int(swapped.state[b]["step"]) == 3


def test_nvme_needs_adam():
    with pytest.raises(
        ValueError, match="needs CPUAdam: optimizer.type Adam, AdamW or CPUAdam .* got SGD"
    ):
        SwappedAdam.replacing(torch.optim.SGD([torch.zeros(3)], lr=0.1), None)


def nvme_memory(stage: int) -> dict:
    torch.manual_seed(0)
    model = EdgeNet()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "sub_group_size": 1024,
            "offload_optimizer": {
                "device": "nvme",
                "buffer_count": 2,
                "nvme_path": os.path.join(tempfile.gettempdir(), "zswap"),
            },
        },
        "steps_per_print": 1000,
    }
    engine, *_ = zengine.initialize(model=model, config=cfg)
    x = torch.randint(0, 37, (2, 5))
    engine.backward(engine(x, x))
    engine.step()
    kinds = engine.optimizer.memory_tensors()
    opt = (
        engine.optimizer
    )  # (ZeRO-Infinity's masters are empty in memory: the groups know the shard's size)
    shard = sum(m.numel() for m in opt.masters) or sum(g.shard_numel for g in opt.groups)
    nbytes = {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in kinds.items()}
    return {
        "states": nbytes["optimizer_states"],
        "masters": nbytes["master_weights"],
        "grads": nbytes["gradients"],
        "shard": shard,
        "world": dist.get_world_size(),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_host_holds_only_the_swap_buffers(stage):
    for r in spawn(nvme_memory, 2, stage):
        assert r["shard"] > 1024  # ... while the shard's moments would take 8 x shard bytes
        if stage == 2:
            assert (
                r["states"] == 2 * 2 * 1024 * 4
            )  # two buffers of [exp_avg | exp_avg_sq] for 1024 elements
        else:  # ZeRO-Infinity: two buffers of [exp_avg | exp_avg_sq | master | grad]; no master or gradient
            assert r["states"] == 2 * 4 * 1024 * 4  # shard in host memory at all
            assert r["masters"] == 0 and r["grads"] == 0
