"""Training with ``shared_memory.enabled`` (collectives through shared memory, distributed/shm.py) gives what
gloo's transport gives: bit for bit on 2 ranks (every sum is one addition), within float rounding on 3."""
import copy

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, train_global_batch
from test_zero_parity import LR, MICRO, STEPS, engine_config
from zengine.distributed import shm, traffic


def _train(stage, precision, gas, shared):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = EdgeNet()
    batches = make_batches(STEPS, MICRO * gas * world)
    cfg = engine_config(stage, precision, gas, world)
    if shared:
        cfg["shared_memory"] = {"enabled": True, "piece_size": 256}  # small pieces: every buffer crosses several
    engine, *_ = zengine.initialize(model=model, config=cfg, model_parameters=edge_param_groups(model, LR))
    traffic.snapshot(reset=True)
    used = shm.for_group(engine.optimizer.comm_group if hasattr(engine.optimizer, "comm_group") else None) is not None
    losses = [train_global_batch(engine, batch, MICRO, gas) for batch in batches]
    with engine.summon_full_params(writeback=False):
        params = {n: p.detach().float().flatten().tolist() for n, p in engine.module.named_parameters()}
    moved = traffic.snapshot()
    gathered = sum(kinds.get("all_gather", {}).get("bytes", 0) for kinds in moved.values())
    engine.destroy()
    return losses, params, used, shm.for_group(None) is None, gathered


def _both(stage, precision, gas):
    shm.MIN_BYTES = 0  # the parity model's buffers are small: take every one through shared memory
    plain = _train(stage, precision, gas, shared=False)
    shared = _train(stage, precision, gas, shared=True)
    return plain, shared


@pytest.mark.parametrize("stage,precision,gas", [(1, "fp32", 1), (2, "bf16", 2), (3, "fp32", 2), (3, "bf16", 1)])
def test_shared_memory_trains_as_gloo_does_on_two_ranks(stage, precision, gas):
    for (plain, shared) in spawn(_both, 2, stage, precision, gas):
        assert shared[2] and not plain[2]  # the transport was used, then released with the engine (shared[3])
        assert shared[3]
        assert shared[0] == plain[0]  # the losses, bit for bit
        assert shared[4] == plain[4] > 0  # the gathers are counted alike (engine.comm_stats)
        for name, p in plain[1].items():
            assert shared[1][name] == p, name


def test_shared_memory_trains_as_gloo_does_on_three_ranks():
    for (plain, shared) in spawn(_both, 3, 3, "fp32", 1):
        assert shared[2]
        assert shared[0] == pytest.approx(plain[0], rel=1e-6)
        for name, p in plain[1].items():
            torch.testing.assert_close(torch.tensor(shared[1][name]), torch.tensor(p), rtol=1e-5, atol=1e-6)
