"""MiCS (``mics_shard_size``, zero/mics.py): stage 3 sharded inside groups of consecutive ranks and replicated
across them. Checked against the single-process torch reference (the parity model and harness of
test_zero_parity.py), against plain stage 3, and through checkpoints that reshard to and from plain stage 3."""

import json

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from test_zero_parity import check_parity, engine_config
from models import EdgeNet, edge_param_groups, make_batches, train_global_batch
from zengine.config import ConfigError, load_config

MICS2 = {"mics_shard_size": 2}
TWO_HOP = {
    "mics_shard_size": 4,
    "mics_hierarchical_params_gather": True,
}  # one shard group over both nodes
STEPS, MICRO = 3, 2


def _memory_and_traffic(extra: dict, save_dir: str = None) -> dict:
    """A few steps of the parity model: this rank's shard elements and the bytes moved by group kind."""
    torch.manual_seed(0)
    model = EdgeNet()
    engine, *_ = zengine.initialize(
        model=model,
        config=engine_config(3, "fp32", 1, dist.get_world_size(), zero_extra=extra),
        model_parameters=edge_param_groups(model, 1e-2),
    )
    engine.comm_stats(reset=True)
    for batch in make_batches(STEPS, MICRO * dist.get_world_size()):
        train_global_batch(engine, batch, MICRO, 1)
    stats = engine.comm_stats(reset=True)
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="plain")
    shard = sum(g.shard_numel for g in engine.optimizer.groups)
    return {"shard": shard, "stats": stats, "params": _params(engine)}


@pytest.mark.parametrize(
    "zero,message",
    [
        ({"stage": 2, "mics_shard_size": 2}, "needs stage 3"),
        ({"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2}, "keep one of them"),
        ({"stage": 3, "mics_shard_size": -3}, "expected -1"),
        ({"stage": 3, "mics_hierarchical_params_gather": True}, "needs mics_shard_size"),
        (
            {
                "stage": 3,
                "mics_shard_size": 2,
                "mics_hierarchical_params_gather": True,
                "zero_quantized_weights": True,
            },
            "keep one of them",
        ),
        (
            {
                "stage": 3,
                "mics_shard_size": 2,
                "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
            },
            "NVMe",
        ),
    ],
)
def test_mics_config_refusals(zero, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, 4)


def _engine(extra: dict, init: bool = False, groups: bool = False):
    torch.manual_seed(0)
    cfg = engine_config(3, "fp32", 1, dist.get_world_size(), zero_extra=extra)
    if init:  # built already cut over the shard groups, as Hugging Face does with the config
        with zengine.zero.MiCS_Init(config_dict_or_path=cfg):
            model = EdgeNet()
    else:
        model = EdgeNet()
    # one param group: under Init the parameters show empty 1-D tensors, so edge_param_groups' split by
    # p.dim() would differ between the engines compared
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, 1e-2) if groups else None
    )
    return engine


def _params(engine) -> dict:
    # (lists: tensors returned by a worker that exits are not readable by the parent)
    return {
        n: zengine.utils.safe_get_full_fp32_param(p).tolist()
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }


def _train(engine, batches) -> None:
    for batch in batches:
        train_global_batch(engine, batch, MICRO, 1)


def _checkpoints(save_dir: str) -> dict:
    batches = make_batches(4, MICRO * dist.get_world_size())
    engine = _engine(MICS2, init=True)
    _train(engine, batches[:2])
    engine.save_checkpoint(save_dir, tag="mics")
    saved = _params(engine)
    _train(engine, batches[2:])
    after = _params(engine)
    resumed = _engine(MICS2)
    resumed.load_checkpoint(save_dir, tag="mics")
    _train(resumed, batches[2:])
    # a write on rank 3 only reaches every copy (the broadcast spans the shard groups)
    weight = engine.module.fc1.weight
    with zengine.zero.GatheredParameters([weight], modifier_rank=3):
        if dist.get_rank() == 3:
            weight.data.fill_(0.25)
    with engine.summon_full_params(writeback=False):
        seen = engine.module.fc1.weight.detach().clone()
    return {
        "saved": saved,
        "after": after,
        "resumed": _params(resumed),
        "fc1": seen.unique().tolist(),
        "fc1_master": zengine.utils.safe_get_full_fp32_param(weight).unique().tolist(),
    }


def _load_plain(save_dir: str) -> dict:
    engine = _engine({})
    engine.load_checkpoint(save_dir, tag="mics")
    params = _params(engine)
    try:  # three ranks do not cut into shard groups of two
        _engine(MICS2)
        refusal = "built"
    except ValueError as e:
        refusal = str(e)
    # groups of one rank: every rank holds whole states, the gradients summed over 3 copies
    check_parity(3, "fp32", 3, False, {"mics_shard_size": 1})
    return {"params": params, "refusal": refusal}


def _mics_cases(save_dir: str) -> dict:
    worst = [
        check_parity(3, "fp32", 1, False, MICS2),
        check_parity(3, "bf16", 3, False, MICS2),
        check_parity(3, "fp32", 3, "param", MICS2),  # parameters and optimizer on the host
        # small parameters (the biases, the norm) stay whole, re-gathered in the shard group after each step
        check_parity(3, "fp32", 1, False, {**MICS2, "stage3_param_persistence_threshold": 100}),
    ]
    plain = _memory_and_traffic({}, save_dir)
    from_plain = _engine(
        MICS2, groups=True
    )  # a plain stage-3 checkpoint (W=4) loaded by MiCS (groups of 2)
    from_plain.load_checkpoint(save_dir, tag="plain")
    return {
        "worst": worst,
        "plain": plain,
        "mics": _memory_and_traffic(MICS2),
        "from_plain": _params(from_plain),
        "two_hop": _memory_and_traffic(TWO_HOP),
        **_checkpoints(save_dir),
    }


def test_mics_trains_like_the_reference_sharded_inside_each_node(tmp_path):
    # 4 ranks as 2 "nodes" of 2, a shard group per node
    out = spawn(_mics_cases, 4, str(tmp_path), env={"LOCAL_WORLD_SIZE": "2"})
    for rank, res in enumerate(out):
        plain, mics = res["plain"], res["mics"]
        # each rank holds half of the states (1/m) instead of a quarter (1/W)
        assert mics["shard"] == pytest.approx(2 * plain["shard"], rel=0.1), (
            rank,
            mics["shard"],
            plain["shard"],
        )
        # the parameter gathers stay inside the node; across nodes only the gradient shards' all-reduce
        assert set(mics["stats"]["inter"]) == {"all_reduce"}, mics["stats"]
        assert mics["stats"]["intra"]["all_gather"]["bytes"] > 0
        assert plain["stats"]["inter"]["all_gather"]["bytes"] > 0
        assert res["from_plain"] == plain["params"], rank
        # the two-hop gather: the same values as the flat one, half the gathered bytes across the nodes
        two_hop = res["two_hop"]
        assert two_hop["params"] == plain["params"], rank
        inter, flat = (
            two_hop["stats"]["inter"]["all_gather"]["bytes"],
            plain["stats"]["inter"]["all_gather"]["bytes"],
        )
        assert inter == pytest.approx(flat / 2, rel=0.02), (inter, flat)
        assert two_hop["stats"]["intra"]["all_gather"]["bytes"] == pytest.approx(flat, rel=0.02)
        # resumed from the checkpoint: bit-identical; every rank saved the same values
        for name in res["after"]:
            assert res["resumed"][name] == res["after"][name], (rank, name)
            assert res["saved"][name] == out[0]["saved"][name], (rank, name)
        # a write on rank 3 only, under GatheredParameters(modifier_rank=3), reaches every copy and the masters
        assert res["fc1"] == [0.25] and res["fc1_master"] == [0.25], rank
    # only the first shard group's pieces are written: the checkpoint is a plain stage-3 one of world 2...
    meta = json.loads((tmp_path / "mics" / "meta.json").read_text())
    assert {piece[0] for pieces in meta["pieces"].values() for piece in pieces} == {0, 1}
    for res in spawn(
        _load_plain, 3, str(tmp_path)
    ):  # ...loaded by plain stage 3 at another world size
        for name, value in out[0]["saved"].items():
            assert res["params"][name] == value, name
        assert "mics_shard_size 2 must divide the data-parallel world size 3" in res["refusal"], (
            res["refusal"]
        )
