"""ZeRO++ hierarchical partitioning (``zero_hpz_partition_size``, zero/stage3/hierarchical.py): the backward
gathers from the secondary shards kept inside each "node", so they never cross nodes, and training is
bit-identical to plain stage 3 (the secondary shards are exact copies of the forward's gathered weights)."""

import pytest
import torch
from torch import nn

import zengine
from configs import SHARD_ALL, ds_config
from harness import spawn
from zengine.config import ConfigError, load_config
from zengine.distributed import traffic

STEPS = 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def _config(hpz: int, quantized: bool = False, gas: int = 1, offload: bool = False) -> dict:
    host = "cpu" if offload else None  # parameters and optimizer on the host (CPU-Adam)
    return ds_config(
        3,
        gas=gas,
        offload_param=host,
        offload_optimizer=host,
        zero={
            **SHARD_ALL,
            "stage3_max_reuse_distance": 0,
            "zero_hpz_partition_size": hpz,
            "zero_quantized_weights": quantized,
        },
    )


def _run(
    hpz: int,
    quantized: bool = False,
    gas: int = 1,
    save_dir: str = None,
    offload: bool = False,
    load_dir: str = None,
    steps: int = STEPS,
) -> dict:
    engine, *_ = zengine.initialize(model=_model(), config=_config(hpz, quantized, gas, offload))
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    losses = []
    engine.comm_stats(reset=True)
    for _ in range(steps * gas):
        # each micro-step's data from its own seed, so that a resumed run sees what an uninterrupted one does
        g = torch.Generator().manual_seed(1000 * torch.distributed.get_rank() + engine.micro_steps)
        x, y = torch.randn(2, 12, generator=g), torch.randn(2, 3, generator=g)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stats = engine.comm_stats(reset=True)
    params = {
        n: zengine.utils.safe_get_full_fp32_param(p).tolist()
        for n, p in engine.module.named_parameters()
    }
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="hpz")
    psi = sum(p.ds_numel * 4 for p in engine.module.parameters())
    return {"losses": losses, "params": params, "stats": stats, "psi": psi}


def _compare(save_dir: str) -> dict:
    return {
        "plain": _run(1),
        "hpz": _run(2, save_dir=save_dir),
        "plain_q": _run(1, True),
        "hpz_q": _run(2, True),
        "plain_gas": _run(1, gas=2),
        "hpz_gas": _run(2, gas=2),
        "plain_off": _run(1, True, offload=True),
        "hpz_off": _run(2, True, offload=True),
        # resumed from the checkpoint saved after STEPS steps: the same as STEPS more steps without a stop
        "hpz_long": _run(2, steps=2 * STEPS),
        "hpz_resumed": _run(2, load_dir=save_dir),
    }


def _load_plain(save_dir: str) -> dict:
    engine, *_ = zengine.initialize(model=_model(), config=_config(1))
    engine.load_checkpoint(save_dir)
    return {
        n: zengine.utils.safe_get_full_fp32_param(p).tolist()
        for n, p in engine.module.named_parameters()
    }


def test_hpz_keeps_the_backward_gather_on_the_node_and_trains_bit_identically(tmp_path):
    out = spawn(
        _compare, 4, str(tmp_path), env={"LOCAL_WORLD_SIZE": "2"}
    )  # 4 ranks as 2 "nodes" of 2
    # its checkpoint is a plain stage-3 one: it loads into plain stage 3 at another world size
    assert spawn(_load_plain, 2, str(tmp_path))[0] == out[0]["hpz"]["params"]
    for rank, res in enumerate(out):
        for plain, hpz in (
            ("plain", "hpz"),
            ("plain_q", "hpz_q"),
            ("plain_gas", "hpz_gas"),
            ("plain_off", "hpz_off"),
        ):
            assert res[hpz]["losses"] == res[plain]["losses"], (rank, plain)
            assert res[hpz]["params"] == res[plain]["params"], (rank, plain)
        assert res["hpz_resumed"]["params"] == res["hpz_long"]["params"], rank
        assert res["hpz_resumed"]["losses"] == res["hpz_long"]["losses"][STEPS:], rank
        stats, psi = res["hpz"]["stats"], res["hpz"]["psi"]
        # plain stage 3 gathers 2 psi per step across the nodes; with hpZ the forward's psi stays inter-node and
        # the backward's psi moves inside the node
        assert abs(res["plain"]["stats"]["inter"]["all_gather"]["bytes"] / STEPS / psi - 2.0) < 0.1
        assert "intra" not in res["plain"]["stats"]
        assert abs(stats["inter"]["all_gather"]["bytes"] / STEPS / psi - 1.0) < 0.05, stats
        assert abs(stats["intra"]["all_gather"]["bytes"] / STEPS / psi - 1.0) < 0.05, stats


@pytest.mark.parametrize(
    "zero,message",
    [
        ({"stage": 2, "zero_hpz_partition_size": 2}, "needs stage 3"),
        ({"stage": 3, "zero_hpz_partition_size": 0}, "zero_hpz_partition_size"),
    ],
)
def test_hpz_config_refusals(zero, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, 4)


def _odd_world() -> str:
    try:
        _run(2)
    except ValueError as e:
        return str(e)
    return "built"


def test_hpz_size_must_divide_the_world():
    for message in spawn(_odd_world, 3):
        assert "zero_hpz_partition_size 2 must divide the data-parallel world size 3" in message, (
            message
        )
