"""FSDP2 beside zengine for the DCP tests: the same model, batches and AdamW on both, checkpoints in
DCP's layouts (PyTorch's tutorial, torchtitan's) written and read by each side."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import zengine
from checkpoint_runs import GLOBAL_BATCH, LR, BufferedNet, batches
from configs import SMALL_BUCKETS, adamw, ds_config
from models import edge_param_groups, micro_batch

STEPS, STOP = 6, 3


def zengine_config(stage: int) -> dict:
    zero = {**SMALL_BUCKETS, "stage3_param_persistence_threshold": 30}
    return ds_config(
        stage,
        micro_batch=GLOBAL_BATCH // dist.get_world_size(),
        optimizer=adamw(LR, betas=[0.9, 0.999], eps=1e-8),
        zero=zero,
        steps_per_print=1000,
    )


def make_engine(stage: int, seed: int):
    torch.manual_seed(seed)
    model = BufferedNet()
    engine, *_ = zengine.initialize(
        model=model, config=zengine_config(stage), model_parameters=edge_param_groups(model, LR)
    )
    return engine


def make_fsdp2(seed: int):
    """BufferedNet under fully_shard on the CPU mesh of every rank, and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = BufferedNet()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(edge_param_groups(model, LR), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    return model, opt


def step(model, x, y, after) -> float:
    """One step on a model or an engine (``after(loss)``: its backward and step); the mean loss."""
    loss = model(x, y)
    after(loss)
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train_fsdp2(model, opt, steps) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()

    def after(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    return [
        step(model, *micro_batch(b, rank, world, GLOBAL_BATCH // world, 0), after) for b in steps
    ]


def train_engine(engine, steps) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()

    def after(loss):
        engine.backward(loss)
        engine.step()

    return [
        step(engine, *micro_batch(b, rank, world, GLOBAL_BATCH // world, 0), after) for b in steps
    ]


def fsdp2_params(model) -> dict[str, list]:
    """FSDP2's parameters whole, as plain lists (every rank gathers)."""
    return {n: p.full_tensor().tolist() for n, p in model.named_parameters()}


def engine_params(engine) -> dict[str, list]:
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().float().tolist() for n, p in engine.module.named_parameters()}


def save_fsdp2(path: str, layout: str, model, opt, step_count: int) -> None:
    """FSDP2's checkpoint: ``tutorial`` ({"model", "optim"} under "app") or ``torchtitan`` (the model at
    the top, a flattened optimizer state, lr_scheduler and train_state)."""
    if layout == "tutorial":
        msd, osd = get_state_dict(model, opt)
        dcp.save({"app": {"model": msd, "optim": osd}}, checkpoint_id=path)
        return
    msd = get_state_dict(model, opt)[0]
    osd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state = {
        **msd,
        "optimizer": osd,
        "train_state": {"step": torch.tensor(step_count, dtype=torch.int32)},
    }
    dcp.save(state, checkpoint_id=path)


def load_fsdp2(path: str, model, opt) -> None:
    """What an FSDP2 user runs: dcp.load into get_state_dict's layout, then set_state_dict."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def close(a: dict, b: dict) -> float:
    """The largest difference between two {name: nested lists} (every name of each)."""
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(
        (torch.tensor(a[n]) - torch.tensor(b[n])).abs().max().item() if a[n] else 0.0 for n in a
    )


def batches_all():
    return batches(STEPS)
