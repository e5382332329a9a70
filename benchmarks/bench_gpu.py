"""One-GPU step time, throughput, MFU and memory of zengine against its peers, side by side in one run.

    python benchmarks/bench_gpu.py                                   # the 1.3B GPT below, every contender
    python benchmarks/bench_gpu.py --contenders torch,zengine-2 --steps 20
    python benchmarks/bench_gpu.py --contenders torch,torch-compiled,zengine-2,zengine-2-compiled,zengine-3-blocks,\
        zengine-3-blocks-compiled --warmup 3 --steps 10          # torch.compile's rows (issue #26)
    python benchmarks/bench_gpu.py --device cpu --layers 2 --d_model 64 --heads 4 --seq 32 --vocab 256 \\
        --micro_batch 2 --steps 2 --warmup 1                         # the CPU smoke run (gloo)

The workload (each an argument): ``zengine.models.GPT`` with 24 layers, d_model 2048, 16 heads, seq 1024,
vocab 50304 (about 1.3B parameters), micro-batch 8, bf16 compute, AdamW (lr 1e-4, wd 0.01), random tokens
from a fixed seed, the same initial weights for every contender. Contenders, one process each (world size 1;
NCCL on a GPU, gloo with ``--device cpu``):

- ``torch``: fp32 parameters, bf16 autocast, ``torch.optim.AdamW(fused=True)``: the bar for stages 0-2;
- ``fsdp2``: ``fully_shard`` per block then the root, ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``,
  fused AdamW: the bar for stage 3;
- ``deepspeed-2`` / ``deepspeed-3`` / ``deepspeed-2-offload``: DeepSpeed with the same config, when it imports;
- ``zengine-0`` .. ``zengine-3``: zengine with ``bf16.enabled`` (bf16 parameters, fp32 masters); stage 3
  at DeepSpeed's defaults, whose gathers zengine groups by block itself (``stage3_gather_units`` "auto");
  ``zengine-3-module``: one gather per module (``stage3_gather_units: "module"``, DeepSpeed's way);
  ``zengine-3-blocks``: stage 3 with each transformer block one gather unit (``set_z3_leaf_modules``), as
  FSDP2 is given one ``fully_shard`` per block;
- ``<contender>-compiled`` (torch, zengine-0 .. zengine-3, zengine-3-blocks): under ``torch.compile``
  (``model.compile()`` for torch, ``engine.compile()`` for zengine), compiled during the warm-up steps (give
  ``--warmup 3``: stage 3 compiles its units at the second step); not in the default list;
- ``zengine-2-offload``: ZeRO-2 with the optimizer on the CPU (CPU-Adam); ``zengine-3-offload``: ZeRO-3 with
  parameters and optimizer on the CPU; ``zengine-infinity``: both on NVMe (``--nvme_path``);
  ``zengine-3-offload-r<ratio>`` (``-r1.0`` and ``-r0.5`` in the default list; any ratio in [0, 1], and
  ``deepspeed-3-offload-r<ratio>`` where DeepSpeed imports): ZeRO-3 with the parameters on the device and
  ``offload_optimizer.ratio`` of the optimizer's sub-groups (``sub_group_size`` 1e8: 13 of the 1.3B GPT) on
  the CPU, the rest stepped on the device (partial offload; r1.0 is the whole optimizer on the CPU).

Offload rows (``*-offload``, ``*-offload-r<ratio>``) are also set against their bound
(``offload_bound.py``): the largest of the device's forward+backward (the same stage without offload),
CPU-Adam over the offloaded share and the link's least traffic, measured on the machine in the same run.

Per contender: median s/step over the timed steps (the device synchronised around each step), tokens/s,
MFU (model FLOPs: 6 x matmul parameters + attention, per token, over the device's dense bf16 peak),
peak device memory (``torch.cuda.max_memory_allocated``), host RSS high-water mark, first and last loss.
The table is written to ``benchmarks/results/gpu_<date>.md`` (to ``--out`` instead when given) after every
contender, so that a run stopped by a time limit keeps what it measured, with the raw figures as JSON beside
it, and printed at the end. A contender that fails or runs past ``--timeout`` is reported as
such and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from common import REPO as ROOT
from common import RESULTS, free_port, rank_env, result_path, today

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.01
# In running order, what the open questions need first (the bars, stage 3 at the defaults and per
# block, stage 2, then offload), so that a run cut short by its time limit still answers them: the
# table is written after every contender.
CONTENDERS = [
    "torch",
    "fsdp2",
    "zengine-3",
    "zengine-3-blocks",
    "zengine-2",
    "deepspeed-3",
    "deepspeed-2",
    "zengine-3-module",
    "zengine-2-offload",
    "zengine-3-offload-r0.5",
    "zengine-3-offload-r1.0",
    "deepspeed-2-offload",
    "zengine-3-offload",
    "zengine-infinity",
    "zengine-0",
    "zengine-1",
]
# "<contender>-compiled" runs the contender under torch.compile (inductor): torch.compile of the model for torch,
# engine.compile() for zengine (#26's GPU rows; not in the default list: the compiles take minutes)
COMPILABLE = ["torch", "zengine-0", "zengine-1", "zengine-2", "zengine-3", "zengine-3-blocks"]
KNOWN = CONTENDERS + [f"{c}-compiled" for c in COMPILABLE]
PARTIAL = ("zengine-3-offload-r", "deepspeed-3-offload-r")  # + a ratio: partial offload's rows
PARTIAL_SUB_GROUP = 100_000_000  # sub_group_size of the partial rows: the 1.3B GPT in 13 sub-groups
# dense bf16 tensor-core peaks (TFLOP/s), by device name
PEAKS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


# -- the workload ------------------------------------------------------------------------------------------
def gpt_config(args):
    from zengine.models.gpt import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
    )


def flops_per_token(args) -> float:
    """Model FLOPs of one trained token: 6 per multiply-accumulate weight (forward 2, backward 4) of the
    blocks and the tied head, plus causal-free attention scores and values (12 x layers x d_model x seq)."""
    matmul = args.layers * 12 * args.d_model**2 + args.vocab * args.d_model
    return 6 * matmul + 12 * args.layers * args.d_model * args.seq


def batch(args, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def zengine_config(args, stage: int, offload: str | None, ratio: float | None = None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    if (
        ratio is not None
    ):  # partial offload: parameters on the device, the optimizer's sub-groups split
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": ratio}
        zero["sub_group_size"] = PARTIAL_SUB_GROUP
    elif offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif offload == "nvme":
        nvme = {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True}
        zero["offload_optimizer"] = dict(nvme, buffer_count=4)
        zero["offload_param"] = dict(nvme, buffer_count=5)
        zero["sub_group_size"] = 100_000_000
        zero["offload_param"]["buffer_size"] = (
            2 * args.vocab * args.d_model
        )  # the largest parameter fits
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
    }


# -- the contenders (each returns step(x, y) -> loss) ----------------------------------------------------------
def torch_adamw(params, device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )


def autocast(args, device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def clipped_steps(model, opt, context=contextlib.nullcontext):
    """(forward_backward, optimizer_step) of a torch model and its optimizer: the forward under
    ``context()``, the gradients clipped to norm 1 before each step."""

    def forward_backward(x, y):
        with context():
            loss = model(x, y)
        loss.backward()
        return loss

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward_backward, optimizer_step


def build_torch(args, model, device):
    model.to(device)
    return clipped_steps(
        model, torch_adamw(model.parameters(), device), lambda: autocast(args, device)
    )


def build_fsdp2(args, model, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return clipped_steps(model, torch_adamw(model.parameters(), device))


def build_engine(
    initialize,
    args,
    model,
    stage: int,
    offload: str | None,
    client_optimizer: bool,
    ratio: float | None = None,
):
    config = zengine_config(args, stage, offload, ratio)
    if client_optimizer:  # DeepSpeed without offload: the same fused torch AdamW as the others
        config.pop("optimizer")
        engine, *_ = initialize(
            model=model, optimizer=torch_adamw(model.parameters(), None), config=config
        )
    else:
        engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)

    def forward_backward(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    forward_backward.engine = engine  # (a "-compiled" contender compiles it)
    return forward_backward, engine.step


def build(name: str, args, model, device):
    if name.endswith(
        "-compiled"
    ):  # the first steps (--warmup) compile; stage 3's units at the second
        base = name[: -len("-compiled")]
        if base == "torch":
            model.compile()
            return build_torch(args, model, device)
        forward_backward, step = build(base, args, model, device)
        forward_backward.engine.compile()
        return forward_backward, step
    if name == "torch":
        return build_torch(args, model, device)
    if name == "fsdp2":
        return build_fsdp2(args, model, device)
    parts = name.split("-")
    stage = int(parts[1]) if parts[1].isdigit() else 3
    if parts[-1] == "blocks":
        from zengine.models.gpt import Block
        from zengine.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [Block])
    offload = {"offload": "cpu", "infinity": "nvme"}.get(parts[-1])
    ratio = float(name.rsplit("-r", 1)[1]) if name.startswith(PARTIAL) else None
    if parts[0] == "zengine":
        import zengine

        def initialize(**kwargs):  # zengine-3-module: DeepSpeed's one gather per module
            if parts[-1] == "module":
                kwargs["config"]["zero_optimization"]["stage3_gather_units"] = "module"
            return zengine.initialize(**kwargs)

        return build_engine(initialize, args, model, stage, offload, False, ratio)
    import deepspeed  # noqa: F401 (ImportError: reported as skipped)

    return build_engine(
        deepspeed.initialize, args, model, stage, offload, offload is None and ratio is None, ratio
    )


# -- one contender in this process --------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(args) -> dict:
    import torch.distributed as dist

    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("ZENGINE_DEVICE", str(device))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    from zengine.models.gpt import GPT

    torch.manual_seed(0)
    started = time.perf_counter()
    model = GPT(gpt_config(args))
    params = sum(p.numel() for p in model.parameters())
    forward_backward, optimizer_step = build(args.worker, args, model, device)
    build_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, fb_times, losses = [], [], []
    for i in range(args.warmup + args.steps):
        x, y = batch(args, i, device)
        sync(device)
        t0 = time.perf_counter()
        loss = forward_backward(x, y)
        if args.split:  # a host sync between the two halves: the split costs a little overlap
            sync(device)
        t1 = time.perf_counter()
        optimizer_step()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            fb_times.append(t1 - t0)
        losses.append(float(loss.detach().float()))  # after the timer: a host read of the loss
    if args.profile and args.out:
        profile(args, forward_backward, optimizer_step, device)
    dist.destroy_process_group()
    s_step = statistics.median(times)
    tokens = args.micro_batch * args.seq / s_step
    peak = PEAKS.get(
        next(
            (k for k in PEAKS if device.type == "cuda" and k in torch.cuda.get_device_name(device)),
            "",
        )
    )
    return {
        "name": args.worker,
        "params": params,
        "build_s": build_s,
        "s_step": s_step,
        "tokens_s": tokens,
        "mfu": tokens * flops_per_token(args) / (peak * 1e12) if peak else None,
        "peak_device_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "times": times,
        "fwd_bwd_s": statistics.median(fb_times) if args.split else None,
    }


def profile(args, forward_backward, optimizer_step, device) -> None:
    """Two more steps under torch.profiler: the top operators by device and by host time, to --out."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for i in range(2):
            x, y = batch(args, 100 + i, device)
            forward_backward(x, y)
            optimizer_step()
        sync(device)
    table = prof.key_averages()
    text = [table.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device.type == "cuda":
        text.append(table.table(sort_by="self_device_time_total", row_limit=30))
    Path(args.out, f"profile_{args.worker}.txt").write_text("\n\n".join(text))


# -- the driver --------------------------------------------------------------------------------------------
def run_contender(name: str, args, argv: list[str]) -> dict:
    """One contender in a fresh process; its result, or why there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(
            os.environ,
            **rank_env(0, 1, free_port(), LOCAL_WORLD_SIZE="1"),
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        cmd = [sys.executable, __file__, *argv, "--worker", name, "--result", out]
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {"name": name, "error": f"ran past --timeout {args.timeout} s"}
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
        return {"name": name, "error": " | ".join(tail) or f"exit status {proc.returncode}"}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(results: list[dict], args) -> str:
    by = {r["name"]: r for r in results if "error" not in r}
    lines = [
        f"# bench_gpu, {today()}",
        "",
        f"Machine: {device_name(args)}; torch {torch.__version__}; python {platform.python_version()}.",
        f"Workload: GPT {args.layers} layers, d_model {args.d_model}, {args.heads} heads, seq {args.seq}, "
        f"vocab {args.vocab} ({next(iter(by.values()))['params'] / 1e6:,.1f}M parameters)"
        if by
        else "",
        f"micro-batch {args.micro_batch}, {args.dtype}, AdamW; {args.warmup} warm-up and {args.steps} timed "
        f"steps per contender (median), one process each.",
        "",
        "| contender | s/step | fwd+bwd s | tokens/s | vs torch | vs FSDP2 | MFU | peak device GiB | "
        "host RSS GiB | first loss | last loss | build s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'][:300]} ||||||||||")
            continue
        ratio = {
            k: (r["tokens_s"] / by[k]["tokens_s"] if k in by else None) for k in ("torch", "fsdp2")
        }
        lines.append(
            f"| {r['name']} | {r['s_step']:.4f} | {fmt(r.get('fwd_bwd_s'), '.4f')} | {r['tokens_s']:,.0f} | {fmt(ratio['torch'], '.2f')} | "
            f"{fmt(ratio['fsdp2'], '.2f')} | {fmt(r['mfu'], '.3f')} | {fmt(r['peak_device_gib'], '.2f')} | "
            f"{r['rss_gib']:.2f} | {r['first_loss']:.4f} | {r['last_loss']:.4f} | {r['build_s']:.1f} |"
        )
    lines += _bound_lines(results, by, args)
    lines += [
        "",
        "Targets (issue 28): zengine stages 0-2 >= 0.95x torch tokens/s; stage 3 >= 0.95x FSDP2 and "
        ">= 1.5x DeepSpeed ZeRO-3; ZeRO-2 + CPU offload <= 0.5 s/step (>= 1.5x DeepSpeed's).",
        f"Reproduce: `python benchmarks/bench_gpu.py {' '.join(sys.argv[1:])}`",
    ]
    return "\n".join(lines)


@functools.cache
def _machine(device: str) -> tuple:
    """(the host's Adam s/element, the link's bytes/s), measured once: the report is written after
    every contender."""
    from offload_bound import host_adam_seconds_per_element, link_bytes_per_second

    return host_adam_seconds_per_element(), link_bytes_per_second(torch.device(device))


def _bound_lines(results: list[dict], by: dict, args) -> list[str]:
    """The offload rows against the step's bound (``offload_bound.py``): device work, host Adam over the
    offloaded share and the link's least traffic, measured on this machine after the contenders ran."""
    from offload_bound import device_row, offload_bound, offload_share

    rows = [r for r in results if "error" not in r and offload_share(r["name"]) is not None]
    if not rows:
        return []
    adam, link = _machine(args.device if args.device != "cuda" else "cuda:0")
    compute_bytes = 4 if args.dtype == "fp32" else 2
    lines = [
        "",
        "Offload rows against their bound: the step can be no faster than the largest of the device's "
        "forward+backward (the same stage without offload), CPU-Adam over the offloaded share "
        f"({adam * 1e9:.2f} ns/element measured here) and the link's least traffic "
        + (
            f"(pinned up {link['up'] / 1e9:.1f} GB/s, down {link['down'] / 1e9:.1f} GB/s measured here)"
            if link
            else "(no device link: CPU run)"
        )
        + "; `of bound` = bound / s/step. Device s is the forward+backward of the row without offload with "
        "`--split`, else its whole step (its own optimizer included: then the bound is looser).",
        "",
        "| contender | s/step | device s | host Adam s | link s | bound s | of bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = by.get(device_row(r["name"]))
        device_s = (base.get("fwd_bwd_s") or base["s_step"]) if base else None
        b = offload_bound(r, device_s, adam, link, compute_bytes)
        r["bound"] = b  # into the JSON too
        lines.append(
            f"| {r['name']} | {r['s_step']:.4f} | {fmt(b['device_s'], '.4f')} | "
            f"{b['host_adam_s']:.4f} | {fmt(b['link_s'], '.4f')} | {b['bound_s']:.4f} | "
            f"{b['of_bound']:.2f} |"
        )
    return lines


def device_name(args) -> str:
    if args.device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda or cpu (the CPU smoke run)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d_model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro_batch", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated, in running order"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per contender")
    p.add_argument(
        "--nvme_path", default=os.path.join(tempfile.gettempdir(), "zengine_bench_gpu_nvme")
    )
    p.add_argument("--out", default=None, help="also write the table and JSON here")
    p.add_argument(
        "--split",
        action="store_true",
        help="also time forward+backward apart (a host sync between)",
    )
    p.add_argument(
        "--profile", action="store_true", help="profile two more steps per contender into --out"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _partial_row(name: str) -> bool:
    """A partial-offload row with a ratio in [0, 1] (``zengine-3-offload-r0.25``)."""
    if not name.startswith(PARTIAL):
        return False
    try:
        return 0.0 <= float(name.rsplit("-r", 1)[1]) <= 1.0
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        try:
            result = worker(args)
        except ImportError as e:
            result = {"name": args.worker, "error": f"skipped: {e}"}
        except Exception as e:  # the driver reports it in the table
            traceback.print_exc()
            result = {"name": args.worker, "error": f"{type(e).__name__}: {e}"}
        with open(args.result, "w") as f:
            json.dump(result, f)
        return
    unknown = [c for c in args.contenders.split(",") if c not in KNOWN and not _partial_row(c)]
    if unknown:
        raise SystemExit(f"bench_gpu: unknown contenders {unknown}; known: {KNOWN}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device here; --device cpu runs the CPU smoke run")
    argv = list(sys.argv[1:] if argv is None else argv)
    stem = "gpu" if args.device.startswith("cuda") else "gpu_cpu"
    out = args.out or str(
        RESULTS
    )  # --out given: there only (the device run brings its folder back)
    Path(out).mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.contenders.split(","):
        result = run_contender(name, args, argv)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "times"}), flush=True)
        # written after every contender: a run stopped by a time limit keeps what it measured
        text = report(results, args)
        result_path(out, stem).write_text(text + "\n")
        result_path(out, stem, "json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
