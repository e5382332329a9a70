"""The DeepSpeed members Lightning's and Fabric's DeepSpeed strategies use, tested without Lightning
(issue 46):

- ``deepspeed.utils.logging.logger`` (the strategies set its level when built);
- the optimizer ``initialize`` returns is a ``deepspeed.runtime.base_optimizer.DeepSpeedOptimizer``
  (Fabric's ``load`` restores the optimizer state only then) with a ``state_dict`` of this rank's
  shard (Lightning's save asks for it): the optimizer's own tensors, copies where NVMe offload
  swaps them out between steps; ``load_state_dict`` refused by name;
- ``save_checkpoint(exclude_frozen_parameters=...)``: both save (what True leaves out:
  tests/checkpoint/test_exclude_frozen.py);
- ``deepspeed.utils.zero_to_fp32.get_optim_files`` / ``get_model_state_file`` (Lightning's
  converter) on zengine checkpoints (stand-in files with the stage, world size and client_state)
  and on DeepSpeed-written ones (tests/fixtures/deepspeed: DeepSpeed's file names, in rank order).
"""

import os
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import zengine
from harness import spawn
from zengine.compat import ALIASES
from zengine.runtime.base_optimizer import DeepSpeedOptimizer
from zengine.utils import zero_to_fp32

FIXTURES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "deepspeed"
)


class Note:
    """A user's own class in client_state (not loadable weights-only)."""


def _engine(stage: int, nvme_path: Optional[str] = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    zero = {"stage": stage}
    if nvme_path:  # Adam's moments and the masters swapped to files between steps
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine, optimizer, _, _ = zengine.initialize(
        model=model, config=cfg, model_parameters=model.parameters()
    )
    for step in range(2):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        loss = engine(torch.randn(2, 4, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
    return engine, optimizer


def _tensors(state: dict) -> list:
    """The masters and Adam's moments of a state_dict, in order."""
    per_param = state["base_optimizer_state"]["state"].values()
    moments = [s[key] for s in per_param for key in ("exp_avg", "exp_avg_sq")]
    return state["single_partition_of_fp32_groups"] + moments


def surface_cases(root: str) -> dict:
    out = {}
    for stage in (2, 3):
        engine, optimizer = _engine(stage)
        state = optimizer.state_dict()
        live = list(optimizer.masters) + [
            optimizer.state[p][key]
            for p in optimizer.shard_params
            for key in ("exp_avg", "exp_avg_sq")
        ]
        mine = _tensors(state)
        shared = len(mine) == len(live) and all(t is l for t, l in zip(mine, live))
        with pytest.raises(NotImplementedError, match="engine.load_checkpoint"):
            optimizer.load_state_dict(state)
        engine.save_checkpoint(root, tag=f"s{stage}_frozen", exclude_frozen_parameters=True)
        folder = os.path.join(root, f"s{stage}")
        engine.save_checkpoint(
            folder,
            tag="ck",
            client_state={"epoch": 3, "note": "x"},
            exclude_frozen_parameters=False,
        )
        engine.save_checkpoint(folder, tag="user", client_state={"obj": Note()})
        out[stage] = {
            "isinstance": isinstance(optimizer, DeepSpeedOptimizer),
            "shared": shared,
            "partition_count": state["partition_count"],
            "numel": sum(m.numel() for m in state["single_partition_of_fp32_groups"]),
        }
        engine.destroy()
    engine, optimizer = _engine(2, os.path.join(root, f"swap{dist.get_rank()}"))
    first = _tensors(optimizer.state_dict())
    seen = [t.clone() for t in first]
    for t in first:
        t.add_(1.0)  # copies: the swapped states keep their values
    again = _tensors(optimizer.state_dict())
    out["nvme"] = {
        "copies": all(torch.equal(a, b) for a, b in zip(again, seen)),
        "moments": all(t.abs().sum() > 0 for t in again),
        "count": len(again),
    }
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def surface(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("surface"))
    return root, spawn(surface_cases, 2, root, timeout=240)


def test_logging_module_has_the_logger():
    assert ALIASES["deepspeed.utils.logging"] == "zengine.utils.logging"
    from zengine.utils import logging as ds_logging

    assert ds_logging.logger is zengine.utils.logger
    level = ds_logging.logger.level
    ds_logging.logger.setLevel(30)  # what the strategies do with their logging_level
    ds_logging.logger.setLevel(level)


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_is_deepspeeds_with_a_state_dict_of_its_shard(surface, stage):
    _, ranks = surface
    for rank in ranks:
        assert rank[stage]["isinstance"] and rank[stage]["shared"]  # its own tensors, as torch's
        assert rank[stage]["partition_count"] == 2
    trained = 4 * 8 + 8 + 8 * 3 + 3
    assert trained <= sum(r[stage]["numel"] for r in ranks) < trained + 2 * 8  # the shards, padded


def test_state_dict_copies_states_swapped_to_nvme(surface):
    _, ranks = surface
    for rank in ranks:
        assert rank["nvme"]["copies"] and rank["nvme"]["moments"] and rank["nvme"]["count"] == 3


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_converter_files_of_a_zengine_checkpoint(surface, stage):
    root, _ = surface
    folder = os.path.join(root, f"s{stage}", "ck")
    optim = zero_to_fp32.get_optim_files(folder)
    # one stand-in per saving rank, as DeepSpeed has one file per rank; nothing written into the checkpoint
    assert len(optim) == 2 and not any(f.startswith(root) for f in optim)
    summary = torch.load(optim[0], weights_only=True)["optimizer_state_dict"]
    assert summary == {"zero_stage": stage, "partition_count": 2}
    model = torch.load(zero_to_fp32.get_model_state_file(folder, stage), weights_only=True)
    assert (model["epoch"], model["note"], model["global_steps"], model["dp_world_size"]) == (
        3,
        "x",
        2,
        2,
    )
    untrusted = os.path.join(root, f"s{stage}", "user")
    with pytest.raises(zengine.checkpoint.CheckpointUntrustedError):
        zero_to_fp32.get_model_state_file(untrusted, stage)


@pytest.mark.parametrize("name,stage", [("s2_fp32_w2", 2), ("s3_fp32_w2", 3)])
def test_lightning_converter_files_of_a_deepspeed_checkpoint(name, stage):
    folder = os.path.join(FIXTURES, name, "global_step3")
    optim = zero_to_fp32.get_optim_files(folder)
    assert [os.path.basename(f) for f in optim] == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)
    ]
    model = zero_to_fp32.get_model_state_file(folder, stage)
    expected = (
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    )
    assert model == os.path.join(folder, expected)


def test_lightning_converter_files_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        zero_to_fp32.get_optim_files(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        zero_to_fp32.get_model_state_file(str(tmp_path), 2)
