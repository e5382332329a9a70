"""A user's training script for the autotuner tests: a stack of wide layers over token ids, trained with
the DeepSpeed loop (``engine(x)``, ``engine.backward``, ``engine.step``) for ``--steps`` optimizer steps.

``--fail_once_below_stage S --marker PATH [--fail_at N]``: the N-th run below stage S (default the
first; PATH counts them) raises ``MemoryError`` on every rank before its first forward: a trial that
fails mid-search. Rank 0 prints ``TRAINED stage=S micro_batch=M steps=N`` at the end.
"""

import argparse
import os

import hjson
import torch
import torch.distributed as dist
from torch import nn

import zengine

WIDTH, LAYERS, SEQ = 2048, 12, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, WIDTH)
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def forward(self, tokens):
        return self.layers(self.emb(tokens)).float().pow(2).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fail_once_below_stage", type=int, default=-1)
    parser.add_argument("--marker", default="")
    parser.add_argument("--fail_at", type=int, default=1)
    zengine.add_config_arguments(parser)
    args = parser.parse_args()
    with open(args.deepspeed_config) as f:
        config = dict(hjson.load(f))
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(model=Net(), config=config)
    mb = engine.train_micro_batch_size_per_gpu()
    if engine.zero_optimization_stage() < args.fail_once_below_stage:
        seen = 0
        if os.path.exists(args.marker):
            with open(args.marker) as f:
                seen = int(f.read() or 0)
        dist.barrier()  # every rank has read the count before rank 0 writes it
        if engine.global_rank == 0:
            with open(args.marker, "w") as f:
                f.write(str(seen + 1))
        if seen + 1 == args.fail_at:
            raise MemoryError(f"simulated: out of memory at micro batch {mb}")
    generator = torch.Generator().manual_seed(engine.global_rank)
    while engine.global_steps < args.steps:
        engine.backward(engine(torch.randint(0, 256, (mb, SEQ), generator=generator)))
        engine.step()
    if engine.global_rank == 0:
        print(
            f"TRAINED stage={engine.zero_optimization_stage()} micro_batch={mb} steps={engine.global_steps}"
        )


if __name__ == "__main__":
    main()
