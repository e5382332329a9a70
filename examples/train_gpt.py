"""Train a tiny byte-level GPT on the repository's own text with zengine.

    zengine --num_procs 2 examples/train_gpt.py --deepspeed_config configs/zero2.json [--steps N] [--compile]

Rank 0 prints, every ``--print_every`` optimizer steps: the mean loss of those
steps over all ranks, the tokens per second of the whole job, and each rank's
model-state memory (``engine.memory_breakdown()``) beside its resident set size.
The training loop is the one a DeepSpeed script has: ``loss = engine(x, y)``,
``engine.backward(loss)``, ``engine.step()``.
"""

from __future__ import annotations

import argparse
import itertools
import hjson  # DeepSpeed-style config files may hold comments and trailing commas
import sys
import time

import psutil
import torch
import torch.distributed as dist

import zengine
from zengine.models import GPT, ByteWindows, bench20m, bench100m, tiny
from zengine.models.gpt import Block

MB = 1024 * 1024
MODELS = {"tiny": tiny, "bench20m": bench20m, "bench100m": bench100m}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps to run")
    parser.add_argument(
        "--print_every", type=int, default=100, help="optimizer steps between reports"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="override the config's peak learning rate (optimizer lr and the scheduler's "
        "warmup_max_lr); the default run uses the config file as it is",
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="seed of the model's initial weights"
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tiny",
        help="the GPT's size: tiny (0.8M parameters, the default), bench20m (21M, the benchmarks') or "
        "bench100m (98M, the autotuning benchmark's)",
    )
    parser.add_argument(
        "--save_dir",
        default=None,
        help="checkpoint here every --save_every steps and at the end; a run started again "
        "(or restarted by `zengine --max_restarts`) resumes from the latest one",
    )
    parser.add_argument(
        "--save_every", type=int, default=0, help="optimizer steps between checkpoints"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (engine.compile): at stage 3 each transformer block becomes "
        "one gather unit (a stage-3 leaf), compiled as one graph with the gathers outside it",
    )
    parser.add_argument(
        "--compile_backend", default="inductor", help="torch.compile backend for --compile"
    )
    zengine.add_config_arguments(parser)
    args = parser.parse_args()
    if not (args.deepspeed_config or args.zengine_config):
        parser.error("pass --deepspeed_config PATH (e.g. configs/zero2.json)")
    return args


def load_config(args: argparse.Namespace):
    """The config file's contents, with the peak learning rate replaced by ``--lr``, ``auto_resume`` pointed
    at ``--save_dir``, and the engine's own progress line off (this script prints one line per report)."""
    path = args.zengine_config or args.deepspeed_config
    with open(path) as f:
        config = dict(hjson.load(f))
    config["steps_per_print"] = float(
        "inf"
    )  # as Hugging Face's integrations do: one progress format
    if args.save_dir is not None:
        config["auto_resume"] = (
            args.save_dir
        )  # initialize loads the latest checkpoint there, if any
    if args.lr is None:
        return config
    config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    scheduler_params = config.get("scheduler", {}).get("params", {})
    for key in ("warmup_max_lr", "cycle_max_lr"):
        if key in scheduler_params:
            scheduler_params[key] = args.lr
    return config


def gather_memory(engine) -> list[dict]:
    """Every rank's model-state bytes by kind and its resident set size (a collective)."""
    mine = dict(engine.memory_breakdown(), rss=psutil.Process().memory_info().rss)
    if engine.device.type == "cuda":
        mine["gpu_peak"] = torch.cuda.max_memory_allocated(engine.device)
    keys = sorted(mine)
    # A tensor all-gather rather than all_gather_object (which needs numpy), on the engine's device:
    # NCCL takes only CUDA tensors.
    local = torch.tensor([float(mine[k]) for k in keys], dtype=torch.float64).to(engine.device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [{k: int(v) for k, v in zip(keys, t.tolist())} for t in gathered]


def mean_over_ranks(total: torch.Tensor, count: int) -> float:
    """Mean of per-step losses summed in ``total`` over ``count`` steps on every rank."""
    total = total.detach().clone()  # on the engine's device (NCCL takes only CUDA tensors)
    dist.all_reduce(total)
    return total.item() / (count * dist.get_world_size())


def format_memory(memory: list[dict]) -> str:
    states = " ".join(
        f"r{r} {sum(v for k, v in m.items() if k not in ('rss', 'gpu_peak')) / MB:.2f}"
        for r, m in enumerate(memory)
    )
    rss = " ".join(f"r{r} {m['rss'] / MB:.0f}" for r, m in enumerate(memory))
    gpu = (
        " | GPU peak MB " + " ".join(f"r{r} {m['gpu_peak'] / MB:.0f}" for r, m in enumerate(memory))
        if "gpu_peak" in memory[0]
        else ""
    )
    return f"model states MB {states} | RSS MB {rss}{gpu}"


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)  # every rank builds the same initial weights
    model_cfg = MODELS[args.model]()
    model = GPT(model_cfg)
    n_params = sum(
        p.numel() for p in model.parameters()
    )  # before initialize: stage 3 cuts them to shards
    dataset = ByteWindows(model_cfg.seq_len)
    if (
        args.compile
    ):  # stage 3 only reads the mark: a block gathered whole is what one compiled graph needs
        zengine.utils.set_z3_leaf_modules(model, [Block])
    engine, _, loader, _ = zengine.initialize(
        model=model, config=load_config(args), training_data=dataset
    )
    if args.compile:
        engine.compile(
            backend=args.compile_backend
        )  # the first steps compile (slower); the rest run compiled
    rank = dist.get_rank()
    tokens_per_step = engine.train_batch_size() * model_cfg.seq_len
    if rank == 0:
        print(
            f"GPT {model_cfg}: {n_params:,} parameters; "
            f"{len(dataset)} windows of {len(dataset.tokens):,} bytes; ZeRO stage "
            f"{engine.zero_optimization_stage()}, world size {engine.world_size}, "
            f"{engine.train_batch_size()} sequences per step, {torch.get_num_threads()} thread(s) per rank",
            flush=True,
        )

    # Summed on the device: no host read per step, only when progress is printed.
    loss_sum, loss_count, first_loss, last_loss = (
        torch.zeros((), device=engine.device),
        0,
        None,
        None,
    )
    start = last_time = time.perf_counter()
    # The data position follows the optimizer step, so a resumed run sees the batches it would have, at
    # any world size: every rank's loader walks the same shuffled order, rank r taking every W-th sample,
    # so global batch s is the same samples at W=4 (accumulation 1) as at W=2 (accumulation 2).
    epoch, skip = divmod(engine.global_steps * engine.gradient_accumulation_steps(), len(loader))
    step = last_step = engine.global_steps
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, None):
            x, y = x.to(engine.device), y.to(engine.device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
            loss_count += 1
            if engine.global_steps == step:
                continue  # a micro-step inside a gradient accumulation: no optimizer step yet
            step = engine.global_steps
            if step % args.print_every == 0 or step == args.steps or step == 1:
                mean_loss = mean_over_ranks(loss_sum, loss_count)
                memory = gather_memory(engine)
                now = time.perf_counter()
                rate = (step - last_step) * tokens_per_step / (now - last_time)
                first_loss = mean_loss if first_loss is None else first_loss
                last_loss = mean_loss
                if rank == 0:
                    print(
                        f"step {step:5d} | loss {mean_loss:.4f} | {rate:8,.0f} tok/s | lr {engine.get_lr()[0]:.2e} "
                        f"| {format_memory(memory)}",
                        flush=True,
                    )
                loss_sum.zero_()
                loss_count, last_step, last_time = 0, step, time.perf_counter()
            if args.save_dir and (
                (args.save_every and step % args.save_every == 0) or step == args.steps
            ):
                engine.save_checkpoint(args.save_dir)
            if step >= args.steps:
                break
        epoch, skip = epoch + 1, 0

    memory = gather_memory(engine)
    if rank == 0:
        elapsed = time.perf_counter() - start
        losses = f"; loss {first_loss:.3f} -> {last_loss:.3f}" if first_loss is not None else ""
        print(f"done: {engine.global_steps} steps in {elapsed:.1f} s{losses}")
        print(
            "model-state bytes by rank: "
            + "; ".join(
                f"r{r} "
                + ", ".join(
                    f"{k} {v / MB:.2f} MB" for k, v in m.items() if k not in ("rss", "gpu_peak")
                )
                for r, m in enumerate(memory)
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
