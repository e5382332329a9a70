"""Shared by the checkpoint tests: a model with buffers, engine configs, and a training loop."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zengine
from configs import SMALL_BUCKETS, adamw, ds_config, nvme, swap_dir
from models import EdgeNet, edge_param_groups, make_batches, micro_batch

LR, CLIP, GLOBAL_BATCH = 1e-2, 0.5, 6


class BufferedNet(EdgeNet):
    """EdgeNet (tied, frozen, unused and odd-sized parameters) plus a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def config(
    stage: int, precision: str = "fp32", offload: bool | str = False, scheduler: bool = False
) -> dict:
    zero = {
        **SMALL_BUCKETS,
        "stage3_param_persistence_threshold": 30,
        "stage3_prefetch_bucket_size": 1500,
    }
    optimizer = param = None
    if offload in (
        "nvme",
        "infinity",
    ):  # Adam's moments swapped to a file, in 700-element chunks through 2 buffers
        optimizer = nvme(swap_dir("zswap"), buffer_count=2)
        zero["sub_group_size"] = 700
    elif offload:
        optimizer = "cpu"
    if offload == "infinity":  # stage 3: the parameter shards in a swap file too (ZeRO-Infinity)
        param = nvme(swap_dir("zswap"), buffer_count=2, buffer_size=4096)
    extra = {}
    if scheduler:
        extra["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": LR, "warmup_num_steps": 3},
        }
    if precision == "fp16":
        extra["fp16"] = {"initial_scale_power": 8, "loss_scale_window": 2}
    return ds_config(
        stage,
        precision,
        micro_batch=GLOBAL_BATCH // dist.get_world_size(),
        optimizer=adamw(LR, betas=[0.9, 0.999], eps=1e-8),
        clip=CLIP,
        zero=zero,
        offload_optimizer=optimizer,
        offload_param=param,
        steps_per_print=1000,
        **extra,
    )


def make_engine(cfg: dict, seed: int):
    torch.manual_seed(seed)
    model = BufferedNet()
    engine, *_ = zengine.initialize(
        model=model, config=cfg, model_parameters=edge_param_groups(model, LR)
    )
    return engine


def batches(steps: int):
    return make_batches(steps, GLOBAL_BATCH)


def train(engine, steps) -> list[float]:
    """One optimizer step per batch; the mean loss over all ranks of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in steps:
        x, y = micro_batch(batch, rank, world, GLOBAL_BATCH // world, 0)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole (in the compute dtype), as a CPU tensor, by name."""
    with engine.summon_full_params(writeback=False):
        return {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}


def as_lists(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """Plain Python values, to return from a spawned rank."""
    return {n: t.float().tolist() for n, t in tensors.items()}
