"""Training with ``shared_memory.enabled`` (collectives through shared memory, distributed/shm.py) gives what
gloo's transport gives: bit for bit on 2 ranks (every sum is one addition), within float rounding on 3; and
what the default ("auto") sets up, and says, for which models and groups."""

import copy
import logging

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
    # small pieces: every buffer crosses several; plain: gloo's transport (shared memory is the default)
    cfg["shared_memory"] = {"enabled": True, "piece_size": 256} if shared else {"enabled": False}
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    traffic.snapshot(reset=True)
    used = (
        shm.for_group(
            engine.optimizer.comm_group if hasattr(engine.optimizer, "comm_group") else None
        )
        is not None
    )
    losses = [train_global_batch(engine, batch, MICRO, gas) for batch in batches]
    with engine.summon_full_params(writeback=False):
        params = {
            n: p.detach().float().flatten().tolist() for n, p in engine.module.named_parameters()
        }
    moved = traffic.snapshot()
    gathered = sum(kinds.get("all_gather", {}).get("bytes", 0) for kinds in moved.values())
    engine.destroy()
    return losses, params, used, shm.for_group(None) is None, gathered


def _both(stage, precision, gas):
    shm.MIN_BYTES = 0  # the parity model's buffers are small: take every one through shared memory
    plain = _train(stage, precision, gas, shared=False)
    shared = _train(stage, precision, gas, shared=True)
    return plain, shared


@pytest.mark.parametrize(
    "stage,precision,gas", [(1, "fp32", 1), (2, "bf16", 2), (3, "fp32", 2), (3, "bf16", 1)]
)
def test_shared_memory_trains_as_gloo_does_on_two_ranks(stage, precision, gas):
    for plain, shared in spawn(_both, 2, stage, precision, gas):
        assert (
            shared[2] and not plain[2]
        )  # the transport was used, then released with the engine (shared[3])
        assert shared[3]
        assert shared[0] == plain[0]  # the losses, bit for bit
        assert shared[4] == plain[4] > 0  # the gathers are counted alike (engine.comm_stats)
        for name, p in plain[1].items():
            assert shared[1][name] == p, name


@pytest.mark.parametrize("stage", [2, 3])
def test_shared_memory_trains_as_gloo_does_on_three_ranks(stage):
    for plain, shared in spawn(_both, 3, stage, "fp32", 1):
        assert shared[2]
        assert shared[0] == pytest.approx(plain[0], rel=1e-6)
        for name, p in plain[1].items():
            torch.testing.assert_close(
                torch.tensor(shared[1][name]), torch.tensor(p), rtol=1e-5, atol=1e-6
            )


WIDE = 1536  # a Linear of 9.0 MiB: pieces of 1.1 MiB on 2 ranks


def _auto_cases():
    """What ``initialize`` installs for each model and ``shared_memory`` section, and what rank 0 logged."""
    import zengine.distributed.shm as mod

    said = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda record: (
        said.append(record.getMessage())
        if record.getMessage().startswith("zengine: shared_memory")
        else None
    )
    logging.getLogger("zengine").addHandler(handler)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    out = {}
    for key, width, section in [
        ("default", WIDE, None),
        ("small", 256, None),
        ("off", WIDE, {"enabled": False}),
        ("capped", WIDE, {"enabled": "auto", "piece_size": 2**30}),
        ("asked", WIDE, {"enabled": "auto", "piece_size": 2**20}),
    ]:
        torch.manual_seed(0)
        model = torch.nn.Linear(width, width)  # WIDE: 9.0 MiB of fp32 parameters; 256: 257 KiB
        engine, *_ = zengine.initialize(
            model=model, config={**cfg, **({"shared_memory": section} if section else {})}
        )
        found = shm.for_group(None)
        out[key] = None if found is None else found.piece_bytes
        out[f"{key}_counted"] = engine.memory_breakdown()[
            "shared_segment"
        ]  # not model state, one per host
        engine.destroy()
    real_host = mod._host_id
    mod._host_id = lambda: 1000 + dist.get_rank()  # as if each rank ran on its own host
    for key in ("auto", True):
        said.clear()
        engine, *_ = zengine.initialize(
            model=torch.nn.Linear(WIDE, WIDE), config={**cfg, "shared_memory": {"enabled": key}}
        )
        out[f"hosts_{key}"] = (shm.for_group(None) is None, list(said))
        engine.destroy()
    mod._host_id = real_host
    real_room = mod._room
    mod._room = lambda: (
        12 * 2**20
    )  # as if /dev/shm had 12 MiB left (a container's is 64 MiB in all)
    for key in ("auto", True):
        engine, *_ = zengine.initialize(
            model=torch.nn.Linear(WIDE, WIDE),
            config={**cfg, "shared_memory": {"enabled": key, "piece_size": 2**20}},
        )
        out[f"room_{key}"] = shm.for_group(None) is not None
        engine.destroy()
    mod._room = real_room
    return out


def test_auto_is_the_default_on_one_host_sized_to_the_model_and_quiet_where_it_does_not_apply():
    model_bytes = (WIDE * WIDE + WIDE) * 4
    for rank, out in enumerate(spawn(_auto_cases, 2)):
        # the segment (2 x world x piece) at most half the model's bytes (8 MiB pieces asked by default)
        assert out["default"] == out["capped"] == model_bytes // 8 // 64 * 64 > shm.MIN_AUTO_PIECE
        assert out["asked"] == 2**20  # a piece_size under the cap is taken as given
        assert out["small"] is None  # its pieces would be under 1 MiB: more syncs than data
        assert out["off"] is None
        assert (
            out["default_counted"] == 2 * 2 * out["default"]
            and out["off_counted"] == out["small_counted"] == 0
        )
        assert out["hosts_auto"] == (True, [])  # ranks on two hosts: gloo, nothing said
        # a 4 MiB segment in a /dev/shm with 12 MiB left: "auto" takes at most a quarter, true takes it
        assert not out["room_auto"] and out["room_True"]
        gone, said = out["hosts_True"]
        assert gone and (len(said) == 1 and "2 hosts" in said[0] if rank == 0 else said == [])


def _default_against_gloo(stage):
    """A DeepSpeed user's config (no shared_memory key) on a model big enough for "auto", against gloo's."""
    out = []
    for section in (None, {"enabled": False}):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(WIDE, WIDE), torch.nn.ReLU(), torch.nn.Linear(WIDE, 16)
        )
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            **({"shared_memory": section} if section else {}),
        }
        engine, *_ = zengine.initialize(model=model, config=cfg)
        used = shm.for_group(None) is not None
        torch.manual_seed(1 + dist.get_rank())
        losses = []
        for _ in range(3):
            loss = engine(torch.randn(2, WIDE)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with engine.summon_full_params(writeback=False):
            digest = [float(p.double().sum()) for p in engine.module.parameters()]
        engine.destroy()
        out.append((used, losses, digest))
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_the_default_trains_as_gloo_does(stage):
    for default, gloo in spawn(_default_against_gloo, 2, stage):
        assert default[0] and not gloo[0]  # "auto" took shared memory, false did not
        assert (
            default[1] == gloo[1] and default[2] == gloo[2]
        )  # losses and parameters, bit for bit (W=2)
