"""Shared by the checkpoint tests: a model with buffers, engine configs, and a training loop."""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import zengine
from models import EdgeNet, edge_param_groups, make_batches, micro_batch

LR, CLIP, GLOBAL_BATCH = 1e-2, 0.5, 6


class BufferedNet(EdgeNet):
    """EdgeNet (tied, frozen, unused and odd-sized parameters) plus a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def config(stage: int, precision: str = "fp32", offload: bool | str = False, scheduler: bool = False) -> dict:
    world = dist.get_world_size()
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
                              "stage3_param_persistence_threshold": 30, "stage3_prefetch_bucket_size": 1500},
        "steps_per_print": 1000,
    }
    if offload in ("nvme", "infinity"):  # Adam's moments swapped to a file, in 700-element chunks through 2 buffers
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "buffer_count": 2,
                                                         "nvme_path": os.path.join(tempfile.gettempdir(), "zswap")}
        cfg["zero_optimization"]["sub_group_size"] = 700
    elif offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if offload == "infinity":  # stage 3: the parameter shards in a swap file too (ZeRO-Infinity)
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "buffer_count": 2, "buffer_size": 4096,
                                                     "nvme_path": os.path.join(tempfile.gettempdir(), "zswap")}
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": LR,
                                                            "warmup_num_steps": 3}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def make_engine(cfg: dict, seed: int):
    torch.manual_seed(seed)
    model = BufferedNet()
    engine, *_ = zengine.initialize(model=model, config=cfg, model_parameters=edge_param_groups(model, LR))
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
