"""Activation memory and step time of a GPT trained with and without activation checkpointing, on the CPU.

    python benchmarks/bench_activation.py [--layers 8] [--width 256] [--heads 4] [--seq 256] [--batch 8]
                                          [--vocab 256] [--steps 3]

The model is ``zengine.models.GPT`` (pre-LayerNorm blocks, causal attention, 4x GELU MLP), fp32,
trained through ``zengine.initialize`` (ZeRO stage 2, one gloo rank, one thread, AdamW). Variants:

- ``none``: the blocks run as they are; autograd keeps every activation until backward;
- ``checkpoint``: each block runs through ``zengine.checkpointing.checkpoint``; only each block's
  input is kept, the rest is recomputed in backward, one block at a time;
- ``checkpoint+cpu``: the same with ``cpu_checkpointing`` (``configure(None, deepspeed_config=config)``
  as DeepSpeed scripts do). On the CPU the kept inputs already are in CPU memory, so it should
  match ``checkpoint``; on a GPU it is what takes those inputs off the device.

How a variant measures (Linux only), each in a fresh process: glibc returns freed blocks above
64 KiB to the system (``mallopt(M_MMAP_THRESHOLD, 65536)``), so resident memory follows live
memory; one warm-up step runs; then for each of ``--steps`` steps, the process's own memory
(RssAnon, as bench_memory reads it) is read before the forward, the high-water mark is reset
(writing "5" to /proc/self/clear_refs), and after the forward own memory is read again (*held after
forward*: the activations kept for backward, and the logits) and after backward the high-water mark
less the shared library pages (*peak in forward+backward*: everything above the start,
gradients included, the same in every variant). The worst step is reported, with the median
step time. The table goes to stdout and to ``benchmarks/results/activation_<date>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from common import REPO, free_port, now, one_process, publish, result_path

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_memory import read_status, reset_peak  # noqa: E402  (own memory, its peak, and the reset)

VARIANTS = ("none", "checkpoint", "checkpoint+cpu")
MB = 1e6
M_MMAP_THRESHOLD = -3


class Checkpointed(nn.Module):
    """A block whose forward goes through ``zengine.checkpointing.checkpoint``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from zengine import checkpointing

        return checkpointing.checkpoint(self.block, x)


def config_for(variant: str, batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2},
        "activation_checkpointing": {"cpu_checkpointing": variant == "checkpoint+cpu"},
    }


def measure(variant: str, args: argparse.Namespace, port: int) -> dict:
    """One variant in this (fresh) process; returns its figures."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)
    except OSError:
        pass
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        ZENGINE_DEVICE="cpu",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    import zengine
    from zengine import checkpointing
    from zengine.models.gpt import GPT, GPTConfig

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.width,
    )
    model = GPT(cfg)
    if variant != "none":
        model.blocks = nn.ModuleList(Checkpointed(block) for block in model.blocks)
    config = config_for(variant, args.batch)
    if variant == "checkpoint+cpu":
        checkpointing.configure(None, deepspeed_config=config)
    engine, *_ = zengine.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        for _ in range(args.steps + 1)
    ]
    held, peaks, times, losses = [], [], [], []
    for i, tokens in enumerate(batches):
        x, y = tokens[:, :-1], tokens[:, 1:]
        start, _ = read_status()
        reset_peak()
        began = time.perf_counter()
        loss = engine(x, y)
        after_forward, _ = read_status()
        engine.backward(loss)
        _, peak = read_status()
        engine.step()
        elapsed = time.perf_counter() - began
        losses.append(loss.item())
        if i == 0:
            continue  # warm-up: lazy allocations and imports
        held.append(after_forward - start)
        peaks.append(peak - start)
        times.append(elapsed)
    copies = checkpointing._HOST_COPIES
    engine.destroy()
    dist.destroy_process_group()
    return {
        "held": max(held),
        "peak": max(peaks),
        "time": statistics.median(times),
        "loss": losses[-1],
        "packed": copies.packed,
        "moved": copies.moved_bytes,
    }


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    return one_process(measure, variant, args, free_port(), label=f"variant {variant}")


def report(args: argparse.Namespace, results: dict, seconds: float) -> str:
    width, seq, batch = args.width, args.seq, args.batch
    block_input = batch * seq * width * 4
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    base = results["none"]
    lines = [
        f"# Activation checkpointing: memory and step time, {now()}",
        "",
        f"Model: zengine.models.GPT, {args.layers} blocks, d_model {width}, {args.heads} heads, seq {seq}, "
        f"vocab {args.vocab}, fp32; micro batch {batch}; ZeRO stage 2 through zengine.initialize, one gloo rank, "
        f"1 thread; AdamW; {args.steps} measured steps after one warm-up step, each variant in a fresh process. "
        f"One block's input is batch x seq x d_model x 4 B = {block_input / MB:.2f} MB.",
        "",
        "held after forward: own memory (RssAnon) after the forward minus before it (what autograd keeps for backward, "
        "and the logits). peak fwd+bwd: the high-water mark (VmHWM less shared library pages) during forward "
        "and backward minus own memory before the forward "
        "(gradients included, the same in every variant). Worst of the measured steps; step time: median "
        "(forward, backward, step). via host hooks: tensors saved through the cpu_checkpointing hooks per run "
        "(bytes copied off a device; 0 here, as the CPU is the device).",
        "",
        "| variant | held after forward (MB) | vs none | peak fwd+bwd (MB) | vs none | step time (s) | vs none "
        "| last loss | via host hooks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        r = results[variant]
        lines.append(
            f"| {variant} | {r['held'] / MB:.1f} | {r['held'] / base['held']:.2f}x | {r['peak'] / MB:.1f} | "
            f"{r['peak'] / base['peak']:.2f}x | {r['time']:.2f} | {r['time'] / base['time']:.2f}x | "
            f"{r['loss']:.6f} | {r['packed']} ({r['moved'] / MB:.1f} MB moved) |"
        )
    lines += [
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
        f"{seconds:.0f} s for the whole run, load average at the end {os.getloadavg()[0]:.1f}. zengine: "
        f"commit {commit.stdout.strip() or '?'}{' + uncommitted changes' if dirty else ''}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    began = time.perf_counter()
    results = {}
    for variant in VARIANTS:
        results[variant] = run_variant(variant, args)
        print(f"{variant}: {results[variant]}", file=sys.stderr)
    publish(report(args, results, time.perf_counter() - began), result_path(args.out, "activation"))


if __name__ == "__main__":
    main()
