"""Gradient bucket buffers are not zeroed: every gradient is copied into its place and only what none wrote
(padding, parameters without a gradient) is zeroed at launch; on the host, released buckets are kept for the
next backward. A buffer full of NaN before every step must not change a thing: the parity model (an unused
layer, a frozen one, sizes no world size divides, a tied weight) at W=3 against the torch reference."""

import copy

import torch
import torch.distributed as dist

import zengine
from harness import spawn
from models import EdgeNet, edge_param_groups, make_batches, train_beside_reference

LR, MICRO, STEPS = 1e-2, 2, 3


def poisoned_runs():
    out = {}
    world = dist.get_world_size()
    batches = make_batches(STEPS, MICRO * world)
    for stage in (2, 3):
        torch.manual_seed(0)
        model = EdgeNet()
        reference = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(edge_param_groups(reference, LR), lr=LR)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 96,
                "overlap_comm": stage == 3,
                "stage3_param_persistence_threshold": 0,
            },
        }
        engine, *_ = zengine.initialize(
            model=model, model_parameters=edge_param_groups(model, LR), config=config
        )
        poisoned = [0]

        def poison():  # what the next backward's buckets are carved from
            for store in engine.optimizer.grads.workspace():
                store.fill_(float("nan"))
                poisoned[0] += store.numel()

        diffs = train_beside_reference(
            engine, reference, ref_opt, batches, MICRO, before_each=poison
        )
        out[stage] = (poisoned[0], max(diffs.values()))
        engine.destroy()
    return out


def test_reused_bucket_buffers_full_of_nan_change_nothing():
    for rank_result in spawn(poisoned_runs, 3):
        for stage, (poisoned, diff) in rank_result.items():
            assert poisoned > 0, (
                stage
            )  # buckets were kept and reused (and poisoned before each step)
            assert diff <= 1e-6, (stage, diff)
