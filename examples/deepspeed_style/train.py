"""A training loop written the way DeepSpeed's examples write it, unchanged from DeepSpeed.

Run it on zengine either with its import lines changed (``import zengine as deepspeed``, ``from
zengine... import``) or as it is, through the compatibility mode:

    zengine --deepspeed_compat --num_gpus 2 examples/deepspeed_style/train.py --out /tmp/ds_style

It uses what DeepSpeed scripts use beyond initialize/backward/step: the accelerator, deepspeed.comm,
RepeatingLoader, set_random_seed, activation checkpointing, the csv monitor, safe_get_full_fp32_param,
save_checkpoint (and the zero_to_fp32.py script it leaves) and destroy. Rank 0 writes the losses and
the final fp32 parameters to ``--out``.
"""

import argparse
import json
import os

import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import RepeatingLoader, safe_get_full_fp32_param


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim=16, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x)  # recomputed in backward
        return self.head(x).squeeze(-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    set_random_seed(1234)
    device = get_accelerator().device_name(get_accelerator().current_device())
    rank, world = dist.get_rank(), dist.get_world_size()

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": args.stage},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False},
        "csv_monitor": {
            "enabled": True,
            "output_path": os.path.join(args.out, "csv"),
            "job_name": "ds_style",
        },
    }
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64))
    model = Net()
    deepspeed.checkpointing.configure(None, deepspeed_config=config)
    engine, _, loader, _ = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=model.parameters(),
        training_data=data,
        config=config,
    )
    batches = iter(RepeatingLoader(loader))
    losses = []
    for step in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    engine.save_checkpoint(os.path.join(args.out, "ckpt"))
    full = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    dist.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "params": {n: t.cpu().tolist() for n, t in full.items()},
                    "world": world,
                    "global_steps": engine.global_steps,
                },
                f,
            )
    engine.destroy()


if __name__ == "__main__":
    main()
