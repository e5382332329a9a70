"""Where the device memory of stages 3 and 2 goes, beside FSDP2's and torch's: peak bytes per parameter on the
stand-in device, by what holds them.

    python benchmarks/bench_device_memory.py [--worlds 2,1] [--layers 4] [--d_model 256] [--window block]
                                             [--contenders module,auto,auto-lean,fsdp2,zengine-2,torch]

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
grouped: gradient shards and masters that are not the shard (``placement``), Adam's moments, the
parameter shards (``group``: fp32, and the masters themselves, when the optimizer is on the device;
stage 2: the whole bf16 parameters, ``flat_group``),
gathered parameters (``param``), gradient buckets (``bucket_buffers``, one rank's reduce-scatter
output), staging for gathers (``gather``), and the rest (activations, autograd's gradients: ``other``).
FSDP2 (``fsdp2``: per block, bf16 parameters, fp32 reduce, AdamW, gradients set to None after each
step) and ``torch`` (DDP, fp32 parameters, bf16 autocast: the bar for ``zengine-2``, stage 2) are
measured the same way, side by side (``_measure_on_host``: on the host, its storages counted as
the device's). Each peak is also split into what was live already after the first step (the states
kept from step to step) and the rest.
Results go to stdout and ``benchmarks/results/device_memory_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the stand-in device lives with the tests

GROUPS = (  # zengine's storages by the code that made them
    # gradient shards (made where a window's first piece lands, on a device), masters not the shard
    ("grads+masters", ("offload/placement", "offload/landing")),
    ("moments", ("zero/step_counts", "torch/optim")),
    # stage-3 shards (with fp32 masters on the device: the masters themselves), stage 2's parameters
    ("parameters", ("zero/stage3/group", "zero/flat_group")),
    ("gathered", ("zero/stage3/param",)),
    ("buckets", ("zero/bucket_buffers", "distributed/collectives")),
    ("staging", ("zero/stage3/gather",)),
)
CONTENDERS = {
    "module": {"stage3_gather_units": "module"},
    "auto": {},
    "auto-lean": {"stage3_max_reuse_distance": 0, "overlap_comm": False},
    "fsdp2": None,  # PEERS
    "zengine-2": {"stage": 2},  # stage 2 (its rows set against torch's)
    "torch": None,
}
PEERS = {
    "fsdp2": "measure_fsdp2",
    "torch": "measure_ddp",
}  # measured on the host (_measure_on_host)


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
                _three_steps(memory, vocab, seq, "meta", engine, engine.backward, engine.step)
    finally:
        dist.destroy_process_group()
    return _result(memory, numel)


def measure_fsdp2(world: int, layers: int, d_model: int, window: int, zero: dict) -> dict:
    """FSDP2 on the same GPT and batch: ``fully_shard`` per block then the root,
    ``MixedPrecisionPolicy(bf16 parameters, fp32 reduce)``, torch's AdamW, ``zero_grad()``
    (set_to_none). FSDP2 needs a device of its own kind (it refuses ``meta`` parameters), so it runs
    on the host with the same fake process group, and the host's storages are counted as the
    device's (``_measure_on_host``)."""

    def prepare(model, world):
        import contextlib

        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh("cpu", list(range(world)))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, contextlib.nullcontext

    return _measure_on_host(world, layers, d_model, prepare)


def measure_ddp(world: int, layers: int, d_model: int, window: int, zero: dict) -> dict:
    """torch's data parallelism, the bar for stages 0-2 (``bench_gpu.py``'s ``torch``): fp32
    parameters, bf16 autocast, DDP, torch's AdamW, ``zero_grad()`` (set_to_none); on the host as
    ``measure_fsdp2``. The fake group's all-reduce has no future for DDP's reducer, so a comm hook
    hands each bucket back as reduced."""

    def prepare(model, world):
        import functools

        import torch

        ddp = torch.nn.parallel.DistributedDataParallel(model)

        def as_reduced(state, bucket):
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        ddp.register_comm_hook(None, as_reduced)
        return ddp, functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)

    return _measure_on_host(world, layers, d_model, prepare)


def _measure_on_host(world: int, layers: int, d_model: int, prepare) -> dict:
    """Three steps of a torch peer, ``prepare(model, world) -> (module, forward context)``, on the
    host under the fake process group, its host storages counted as device memory: the same count by
    storage as the stand-in's, without CUDA's streams (FSDP2's overlap on a GPU holds a little more:
    the next block's all-gather while this one computes)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from device_memory import DeviceMemory
    from zengine.models.gpt import GPT, GPTConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    memory = DeviceMemory("cpu")
    vocab, seq = 4 * d_model, 64
    try:
        with memory:
            cfg = GPTConfig(
                vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=4, d_model=d_model
            )
            model = GPT(cfg)
            numel = sum(p.numel() for p in model.parameters())
            module, context = prepare(model, world)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def forward(x, y):
                # attention as the stand-in runs it (``meta`` has only the math path, which keeps
                # the attention weights for backward): the same activations for every contender
                with context(), sdpa_kernel(SDPBackend.MATH):
                    return module(x, y)

            def step():
                opt.step()
                opt.zero_grad()

            _three_steps(memory, vocab, seq, "cpu", forward, lambda loss: loss.backward(), step)
    finally:
        dist.destroy_process_group()
    return _result(memory, numel)


def _three_steps(memory, vocab: int, seq: int, device: str, forward, backward, step) -> None:
    """Three steps of micro-batch 4, each phase's peak its own; the states live after the first step
    marked as kept. The step's own peak does not count: torch's foreach Adam runs there (on ``meta``
    for zengine too), whose temporaries, two fp32 copies of the moments' shard, a GPU's fused Adam
    does not make."""
    import torch

    for i in range(3):
        x = torch.randint(0, vocab, (4, seq), device=device)
        memory.phase(f"forward {i}")
        loss = forward(x, x)
        memory.phase(f"backward {i}")
        backward(loss)
        memory.phase(f"step {i}", counts=False)
        step()
        if i == 0:
            memory.mark_kept()


def _result(memory, numel: int) -> dict:
    """The run's peak, when, what was live then (by group and by line) and how much of it the
    storages kept from step to step were."""
    groups = dict.fromkeys([name for name, _ in GROUPS] + ["other"], 0)
    for site, nbytes in memory.peak_sites().items():
        name = next((n for n, where in GROUPS if any(w in site for w in where)), "other")
        groups[name] += nbytes
    counted = {k: v for k, v in memory.peaks.items() if not k.startswith("step")}
    worst = max(counted, key=counted.get)
    steps = max(v for k, v in memory.peaks.items() if k.startswith("step"))
    return {
        "numel": numel,
        "peak": memory.peak,
        "kept": memory.peak_kept,
        "groups": groups,
        "at": worst,
        "step": steps,
        "sites": memory.peak_sites(),
    }


def run(name: str, world: int, layers: int, d_model: int, window: int) -> dict:
    """Contender ``name`` measured in a fresh process."""
    from device_guard import run_on_meta

    if name in PEERS:
        return run_on_meta(globals()[PEERS[name]], world, layers, d_model, window, {})
    return run_on_meta(measure, world, layers, d_model, window, CONTENDERS[name])


def tables(results: dict, world: int) -> list[str]:
    """The side-by-side table (peak, kept states, transients, against FSDP2) and zengine's detail."""
    n = next(iter(results.values()))["numel"]
    fsdp2, torch_ddp = results.get("fsdp2"), results.get("torch")
    head = [x for x, _ in GROUPS] + ["other"]
    lines = [
        f"### W = {world}",
        "",
        "| contender | peak B/param | in | kept from step to step | the rest | vs fsdp2 | vs torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratios = [f"{r['peak'] / p['peak']:.3f}x" if p else "-" for p in (fsdp2, torch_ddp)]
        lines.append(
            f"| {name} | {r['peak'] / n:.2f} | {r['at']} | {r['kept'] / n:.2f} | "
            f"{(r['peak'] - r['kept']) / n:.2f} | " + " | ".join(ratios) + " |"
        )
    lines += [
        "",
        "| zengine | " + " | ".join(head) + " | step (foreach Adam) |",
        "|---|" + "---|" * (len(head) + 1),
    ]
    for name, r in results.items():
        if name not in PEERS:
            cells = [f"{r['groups'][g] / n:.2f}" for g in head]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['step'] / n:.2f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,1", help="world sizes, comma-separated")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--window", default="block", help="elements, or 'block'")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default=None, help="results file (default: results/<date>)")
    args = parser.parse_args(argv)
    block = block_elements(args.d_model)
    window = block if args.window == "block" else int(float(args.window))
    body = []
    for world in (int(w) for w in args.worlds.split(",")):
        names = args.contenders.split(",")
        results = {name: run(name, world, args.layers, args.d_model, window) for name in names}
        body += tables(results, world)
    n = next(iter(results.values()))["numel"]
    lines = [
        f"# Device memory of stages 2-3 on the stand-in device, {datetime.date.today()}",
        "",
        f"GPT {args.layers} layers, d_model {args.d_model} ({n:,} parameters), bf16, AdamW, "
        "rank 0 of torch's fake process group, micro-batch 4, seq 64; zengine at DeepSpeed's "
        f"stage-3 defaults with stage3_prefetch_bucket_size {window:,} (one block) and "
        f"stage3_param_persistence_threshold {4 * args.d_model}; FSDP2 per block, bf16 parameters, "
        "fp32 reduce, zero_grad() to None; zengine-2 stage 2 at DeepSpeed's defaults; torch: DDP, fp32 "
        "parameters, bf16 autocast, zero_grad() to None. Bytes per parameter at the peak of the forwards and "
        "backwards of three steps; 'kept' is what of it was already live after the first step (the "
        "states a run keeps), 'the rest' what the forward and backward made (gathered parameters, "
        "buckets, activations, FSDP2's gradients).",
        "",
        *body,
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
