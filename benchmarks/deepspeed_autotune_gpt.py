"""Train the autotuning benchmark's GPT with DeepSpeed's own engine, for DeepSpeed's autotuner.

    pip install tabulate   # DeepSpeed's autotuner needs it (the deepspeed[autotuning] extra)
    LOCAL_SIZE=2 DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --autotuning tune --num_gpus 2 \\
        benchmarks/deepspeed_autotune_gpt.py --deepspeed_config configs/autotuning/deepspeed_gpt.json

Only the model and the data are zengine's (``zengine.models``); the training loop is DeepSpeed's:
``deepspeed.initialize`` with the config path the autotuner passes to each experiment, then
forward/backward/step on the DeepSpeed engine, which times the profile steps and exits by itself
when the config's ``autotuning`` section is on (as in the scripts of DeepSpeed's autotuning docs).
Run with the DeepSpeed venv's python (/tmp/dsv here), not zengine's. ``LOCAL_SIZE=2``: DeepSpeed's CPU
accelerator counts NUMA nodes as devices (one here) unless told, and the autotuner then refuses two ranks.
Results: benchmarks/results/autotuning_2026-11-29.md, "DeepSpeed's autotuner on the same job".
"""

import argparse

import deepspeed
import torch

from zengine.models.data import ByteWindows
from zengine.models.gpt import GPT, bench100m, tiny

MODELS = {"tiny": tiny, "bench100m": bench100m}


def parse_args() -> argparse.Namespace:
    """The model size, the number of steps and DeepSpeed's own arguments (``--deepspeed_config``,
    ``--local_rank``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="bench100m")
    parser.add_argument(
        "--steps", type=int, default=20, help="optimizer steps (the autotuner stops sooner)"
    )
    parser.add_argument("--local_rank", type=int, default=-1)
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    """Build the GPT, hand it to DeepSpeed and train it for ``--steps`` optimizer steps."""
    args = parse_args()
    torch.manual_seed(0)  # every rank builds the same initial weights
    cfg = MODELS[args.model]()
    model = GPT(cfg)
    dataset = ByteWindows(cfg.seq_len)
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            step = engine.global_steps
            if step >= args.steps:
                break
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
