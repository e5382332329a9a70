"""Where stage 3's device memory goes: peak bytes per parameter on the stand-in device, by what holds them.

    python benchmarks/bench_device_memory.py [--world 2] [--layers 4] [--d_model 256] [--window block]
                                             [--contenders module,auto,auto-lean]

No GPU is needed: the run trains on ``meta`` under the device guard's stand-ins (``tests/device_guard.py``:
CUDA's device rules, torch's fake process group for W ranks, this being rank 0) and counts every device
storage by the line that made it (``tests/device_memory.py``), as ``torch.cuda.max_memory_allocated``
would count them. A GPT (``zengine.models.gpt``), bf16, AdamW, DeepSpeed's stage-3 defaults
(reuse distance and live parameters 1e9, reduce bucket 5e8) with the prefetch window ``--window``
elements (``block``: one transformer block, as DeepSpeed's 5e7 is a block of a billion-parameter model)
and the persistence threshold 4 x d_model (vectors whole, matrices sharded, as 1e5 leaves such a model).
Contenders: ``module`` (``stage3_gather_units: "module"``, DeepSpeed's lifetimes), ``auto`` (the default,
``zero/stage3/units.py``), ``auto-lean`` (``auto`` with reuse distance 0 and one bucket in flight).

The table gives the peak of the forwards and backwards of three steps in bytes per parameter (the
step's own peak apart: on ``meta`` torch's Adam runs its foreach path, whose temporaries, two fp32
copies of the moments' shard, a GPU's fused Adam does not make) and what was live at that moment,
grouped: fp32 masters and gradient shards (``placement``), Adam's moments (``step_counts``), the bf16
parameter shards (``group``), gathered parameters (``param``), gradient buckets (``bucket_buffers``),
staging for gathers (``gather``), and the rest (activations, autograd's gradients: ``other``). FSDP2 with
fp32 parameters and bf16 compute holds 16/W bytes a parameter of model state (fp32 parameters,
gradients, two moments) plus a block or two gathered and the activations.
Results go to stdout and ``benchmarks/results/device_memory_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the stand-in device lives with the tests

GROUPS = (
    ("masters+grads", "offload/placement"),
    ("moments", "zero/step_counts"),
    ("shards", "zero/stage3/group"),
    ("gathered", "zero/stage3/param"),
    ("buckets", "zero/bucket_buffers"),
    ("staging", "zero/stage3/gather"),
)
CONTENDERS = {
    "module": {"stage3_gather_units": "module"},
    "auto": {},
    "auto-lean": {"stage3_max_reuse_distance": 0, "overlap_comm": False},
}


def block_elements(d_model: int) -> int:
    """Elements of one of the GPT's blocks: 12 d^2 in its matrices, a few vectors of d."""
    return 12 * d_model**2 + 16 * d_model


def measure(world: int, layers: int, d_model: int, window: int, zero: dict) -> dict:
    """One run on the stand-in device (in a fresh process: the guard patches module state)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zengine
    from device_guard import DeviceRulesMode, FakeCollectives, HostReads, side_streams_on_meta
    from device_memory import DeviceMemory
    from zengine.models.gpt import GPT, GPTConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    memory = DeviceMemory()
    vocab, seq = 4 * d_model, 64
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": window,
            # vectors whole, matrices sharded: what 1e5 does to a billion-parameter model's layers
            "stage3_param_persistence_threshold": 4 * d_model,
            **zero,
        },
    }
    try:
        with HostReads(world).installed(), FakeCollectives().installed():
            with side_streams_on_meta(), DeviceRulesMode(), memory:
                cfg = GPTConfig(
                    vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=4, d_model=d_model
                )
                with torch.device("meta"):
                    model = GPT(cfg)
                numel = sum(p.numel() for p in model.parameters())
                engine, *_ = zengine.initialize(model=model, config=config)
                for step in range(3):
                    x = torch.randint(0, vocab, (4, seq), device="meta")
                    memory.phase(f"forward {step}")
                    loss = engine(x, x)
                    memory.phase(f"backward {step}")
                    engine.backward(loss)
                    memory.phase(f"step {step}", counts=False)  # (foreach Adam on meta)
                    engine.step()
    finally:
        dist.destroy_process_group()
    groups = dict.fromkeys([name for name, _ in GROUPS] + ["other"], 0)
    for site, nbytes in memory.peak_sites().items():
        name = next((n for n, where in GROUPS if where in site), "other")
        groups[name] += nbytes
    counted = {k: v for k, v in memory.peaks.items() if not k.startswith("step")}
    worst = max(counted, key=counted.get)
    steps = max(v for k, v in memory.peaks.items() if k.startswith("step"))
    sites = memory.peak_sites()
    return {
        "numel": numel,
        "peak": memory.peak,
        "groups": groups,
        "at": worst,
        "step": steps,
        "sites": sites,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--window", default="block", help="elements, or 'block'")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default=None, help="results file (default: results/<date>)")
    args = parser.parse_args(argv)
    from device_guard import run_on_meta

    block = block_elements(args.d_model)
    window = block if args.window == "block" else int(float(args.window))
    rows = []
    for name in args.contenders.split(","):
        r = run_on_meta(measure, args.world, args.layers, args.d_model, window, CONTENDERS[name])
        n = r["numel"]
        cells = [f"{r['groups'][g] / n:.2f}" for g in [x for x, _ in GROUPS] + ["other"]]
        peak, step = r["peak"] / n, r["step"] / n
        rows.append(
            f"| {name} | {peak:.2f} | {r['at']} | " + " | ".join(cells) + f" | {step:.2f} |"
        )
    head = [x for x, _ in GROUPS] + ["other"]
    lines = [
        f"# Stage-3 device memory on the stand-in device, {datetime.date.today()}",
        "",
        f"GPT {args.layers} layers, d_model {args.d_model} ({n:,} parameters), bf16, AdamW, "
        f"W = {args.world} (rank 0 of torch's fake process group), micro-batch 4, seq 64; DeepSpeed's "
        f"stage-3 defaults with stage3_prefetch_bucket_size {window:,} (one block) and "
        f"stage3_param_persistence_threshold {4 * args.d_model}. Bytes per "
        "parameter at the peak of the forwards and backwards of three steps, and what was live then.",
        "",
        "| contender | peak B/param | in | " + " | ".join(head) + " | step (foreach Adam) |",
        "|---|---|---|" + "---|" * (len(head) + 1),
        *rows,
        "",
        f"FSDP2 (fp32 parameters, bf16 compute) holds {16 / args.world:.2f} B/param of model state "
        "here, plus a block or two gathered and the activations ('other').",
        "Reproduce: `python benchmarks/bench_device_memory.py "
        + " ".join(argv or sys.argv[1:])
        + "`",
    ]
    text = "\n".join(lines)
    print(text)
    out = args.out or os.path.join(HERE, "results", f"device_memory_{datetime.date.today()}.md")
    with open(out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
