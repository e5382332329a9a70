"""Bytes each rank's collectives move per optimizer step, measured, against the ZeRO formulas.

    python benchmarks/bench_comm.py [--world 4] [--per-node 2] [--steps 4] [--stages 1,2,3,3q,3h,3g,3qhg,3m,3mh]

W gloo ranks as W / per-node "nodes" (``LOCAL_WORLD_SIZE``; 4 as 2 x 2 by default) train the main job's
GPT (``zengine.models.tiny()``, fp32, AdamW, micro batch 4) for ``steps`` steps at each stage, after two
warm-up steps; ``engine.comm_stats()`` (zengine/distributed/traffic.py) counts the payload of every
collective the engine ran, by collective and by whether its group spans nodes. The table gives bytes per
step in units of Ψ (the model's parameter bytes in the compute dtype) next to the formula's, and the bytes
one rank sends on a ring, with stage 3's persistence threshold and reuse distance at 0 so that every
parameter is gathered for the forward and again for the backward (with DeepSpeed's default reuse distance,
1e9, a model this small stays gathered from its forward to its backward: one all-gather per step).

``3q`` is stage 3 with ZeRO++'s quantized weights (``zero_quantized_weights``: the parameter gathers as
blockwise int8), ``3h`` with its hierarchical partitioning (``zero_hpz_partition_size`` = ranks per node:
the backward's gathers inside the node), ``3g`` with its quantized gradients (``zero_quantized_gradients``:
an int8 all-to-all in place of the reduction), ``3qhg`` all three; each with its loss after the run beside
stage 3's. ``3m`` is MiCS with a shard group per node (``mics_shard_size`` = ranks per node: the gathers and the
gradient reduction inside the node, the shards' all-reduce across the copies), ``3mh`` MiCS with one shard group
over every rank and its two-hop gather (``mics_hierarchical_params_gather``). Results go to
``benchmarks/results/comm_<date>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from common import REPO, join_group, now, publish, result_path, spawn_ranks

sys.path.insert(0, str(REPO))

import zengine  # noqa: E402
from zengine.distributed import traffic  # noqa: E402
from zengine.models import GPT, ByteWindows, tiny  # noqa: E402

MICRO = 4
# What the ZeRO paper counts per step, in Ψ, for the collectives zengine runs on CPU (gloo): stages 1-2
# reduce the gradients with an all-reduce (measured faster than reduce-scatter on gloo; the same Ψ payload)
# and all-gather the updated parameters; stage 3 gathers the parameters twice (forward and backward) and
# reduce-scatters the gradients.
# On gloo stage 3 also sums gradients with an all-reduce in place of the reduce-scatter (the same payload).
FORMULA = {  # (collective, group kind) -> Ψ per step
    "1": {("all_reduce", "inter"): 1.0, ("all_gather", "inter"): 1.0},
    "2": {("all_reduce", "inter"): 1.0, ("all_gather", "inter"): 1.0},
    "3": {("all_gather", "inter"): 2.0, ("all_reduce", "inter"): 1.0},
    # int8 + one fp32 scale per 256 elements, against the fp32 model's 4 bytes per element
    "3q": {("all_gather", "inter"): 2.0 * (1 + 4 / 256) / 4, ("all_reduce", "inter"): 1.0},
    # the backward's gathers inside the node (from the secondary shards, exact)
    "3h": {
        ("all_gather", "inter"): 1.0,
        ("all_gather", "intra"): 1.0,
        ("all_reduce", "inter"): 1.0,
    },
    "3g": {("all_gather", "inter"): 2.0, ("all_to_all", "inter"): (1 + 4 / 256) / 4},
    "3qhg": {
        ("all_gather", "inter"): (1 + 4 / 256) / 4,
        ("all_gather", "intra"): 1.0,
        ("all_to_all", "inter"): (1 + 4 / 256) / 4,
    },
    # MiCS, 2 groups of 2 (one per node): gathers and the gradient sum inside the node, then the Ψ/2 shard summed
    # over the 2 copies across the nodes
    "3m": {
        ("all_gather", "intra"): 2.0,
        ("all_reduce", "intra"): 1.0,
        ("all_reduce", "inter"): 0.5,
    },
    # MiCS, one group of 4, two-hop gathers: each gather's first hop across the nodes carries half the rows
    "3mh": {
        ("all_gather", "inter"): 1.0,
        ("all_gather", "intra"): 2.0,
        ("all_reduce", "inter"): 1.0,
    },
}


def rank_job(rank: int, world: int, port: int, per_node: int, args, out: str) -> None:
    join_group(rank, world, port, LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node))
    results = {}
    for name in args.stages:
        stage = int(name[0])
        torch.manual_seed(0)
        cfg = tiny()
        model = GPT(cfg)
        psi = sum(p.numel() * p.element_size() for p in model.parameters())
        engine, _, loader, _ = zengine.initialize(
            model=model,
            training_data=ByteWindows(cfg.seq_len),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                "zero_optimization": {
                    "stage": stage,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_max_reuse_distance": 0,
                    "zero_quantized_weights": "q" in name,
                    "zero_quantized_gradients": "g" in name,
                    "zero_hpz_partition_size": per_node if name in ("3h", "3qhg") else 1,
                    "mics_shard_size": {"3m": per_node, "3mh": world}.get(name, -1),
                    "mics_hierarchical_params_gather": name == "3mh",
                },
            },
        )
        batches = iter(loader)
        times = []
        for step in range(2 + args.steps):
            if step == 2:
                engine.comm_stats(reset=True)
            start = time.perf_counter()
            x, y = next(batches)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        stats = engine.comm_stats(reset=True)
        results[name] = {
            "psi": psi,
            "stats": stats,
            "loss": loss.item(),
            "step_s": statistics.median(times[2:]),
        }
        engine.destroy()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stages", default="1,2,3,3q,3h,3g,3qhg,3m,3mh")
    parser.add_argument(
        "--out", default=None, help="folder for the markdown table (default benchmarks/results)"
    )
    args = parser.parse_args(argv)
    args.stages = args.stages.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        spawn_ranks(rank_job, args.world, args.per_node, args, out)
        with open(out) as f:
            results = json.load(f)
    report(args, results)


def report(args, results: dict) -> None:
    nodes = args.world // args.per_node
    lines = [
        f"# Communication per optimizer step, {now()}",
        "",
        f"{args.world} gloo ranks as {nodes} nodes of {args.per_node} (LOCAL_WORLD_SIZE), the main job's GPT "
        f"(fp32), micro batch {MICRO}, {args.steps} steps after 2 warm-up steps; stage 3 with persistence "
        f"threshold and reuse distance 0. Ψ = the model's parameter bytes. Payload: the buffer each collective moves as a whole; "
        f"ring: what one rank sends for it on a ring ((W-1)/W of it, twice for an all-reduce). A group is "
        f"inter-node when its ranks are on more than one node (the world group is).",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs. Command: "
        f"`python benchmarks/bench_comm.py --world {args.world} --per-node {args.per_node} "
        f"--steps {args.steps}`. Step times are CPU processes on gloo sharing this machine's cores (every "
        f"collective is a local copy): they show the cost of the extra work (quantizing, two hops), not what a "
        f"network would save.",
        "",
        "| stage | collective | group | calls / step | payload / step (Ψ) | formula (Ψ) | ring sent / step (Ψ) | "
        "loss at the end | s/step (rank 0, median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, res in results.items():
        psi, stats = res["psi"], res["stats"]
        for kind, per in stats.items():
            for collective, v in per.items():
                expected = FORMULA.get(stage, {}).get((collective, kind))
                lines.append(
                    f"| {stage} | {collective} | {kind} | {v['calls'] / args.steps:.1f} | "
                    f"{v['bytes'] / args.steps / psi:.3f} | "
                    f"{'' if expected is None else f'{expected:.2f}'} | "
                    f"{v['ring_bytes'] / args.steps / psi:.3f} | | |"
                )
        total = traffic.total(stats) / args.steps / psi
        lines.append(
            f"| {stage} | **all** | | | **{total:.3f}** | {sum(FORMULA.get(stage, {}).values()):.2f} | | "
            f"{res['loss']:.4f} | {res['step_s']:.3f} |"
        )
    lines += [
        "",
        "ZeRO++ and MiCS formulas (inter-node payload per step in Ψ of a 2-byte model, stage 3; qwZ is "
        "measured above as 3q, hpZ as 3h, qgZ (int8 here) as 3g, MiCS as 3m and 3mh): plain 3.0 (forward and backward all-gather, reduce-scatter); qwZ (int8 "
        "weights in the forward all-gather) 2.5; hpZ (backward all-gather inside the node) 2.0; qgZ (int4 "
        "gradient reduce-scatter) replaces 1.0 by 0.25; qwZ + hpZ + qgZ 0.75 (4x less); MiCS with shards "
        "inside a node: 2(R-1)/R x Ψ/s for the gradient all-reduce across R replicas of s-rank groups.",
    ]
    publish("\n".join(lines) + "\n", result_path(args.out, "comm"))


if __name__ == "__main__":
    main()
