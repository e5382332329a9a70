"""Run by tests/checkpoint/test_universal.py under a Python that has DeepSpeed 0.19.8 (never zengine's test
environment): DeepSpeed itself loads a universal checkpoint with ``checkpoint.load_universal`` and trains
CONTINUED steps; rank 0 writes its losses and fp32 masters to OUTPUT, a list by (SAVE_DIR, STAGE) pair.

    python tests/checkpoint/deepspeed_universal_load.py OUTPUT WORLD SAVE_DIR STAGE [SAVE_DIR STAGE ...]

The model starts from the saving run's seed: DeepSpeed's universal load restores the trained parameters
only (it skips the module's state_dict: frozen parameters and buffers keep the model's own values).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported (also in the ranks)
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.dirname(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

from deepspeed_runs import CONTINUED, SAVED_AT, TiedLM, batches, config, make_optimizer, train  # noqa: E402
from harness import spawn  # noqa: E402


def load_and_train(output: str, targets: list) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = [one(save_dir, stage) for save_dir, stage in targets]
    if torch.distributed.get_rank() == 0:
        torch.save(out, output)


def one(save_dir: str, stage: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    world = torch.distributed.get_world_size()
    torch.manual_seed(0)  # the saving run's: the frozen parameters' values (see the module doc)
    model = TiedLM()
    cfg = {**config(stage, "fp32", world), "checkpoint": {"load_universal": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=cfg)
    engine.load_checkpoint(save_dir)
    steps = engine.global_steps
    decay = [g["weight_decay"] for g in engine.optimizer.param_groups]
    losses = train(engine, batches(SAVED_AT + CONTINUED)[SAVED_AT:])
    after = {
        n: safe_get_full_fp32_param(p).detach().cpu().clone()
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }
    engine.destroy()
    return {"steps": steps, "losses": losses, "after": after, "weight_decay": decay}


if __name__ == "__main__":
    output, world, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    targets = [(rest[i], int(rest[i + 1])) for i in range(0, len(rest), 2)]
    spawn(load_and_train, world, output, targets, env={"DS_ACCELERATOR": "cpu"})
