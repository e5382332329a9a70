"""ZeRO-Infinity on this machine: the largest GPT it trains with parameters and optimizer on NVMe.

    OMP_NUM_THREADS=2 python benchmarks/bench_infinity.py [--layers 32 --d-model 2560] [--steps 4]
                                                          [--dir /var/tmp/zengine-infinity]
                                                          [--variants bf16 | fp32,bf16-native,bf16-fp32mm,
                                                                      bf16-states,bf16-states-sr]

One process (W=1), stage 3, bf16, AdamW; the model is built under ``zero.Init`` straight into the
parameter swap file, so it is never whole in memory. Every state of size N lives on disk: the bf16
parameters (2 bytes each) and, per optimizer chunk, ``[exp_avg | exp_avg_sq | fp32 master | fp32 grad]``
(16 bytes each; with ``bf16-states``, bf16 masters, gradients and moments, 8 bytes: 10 per parameter
on disk instead of 18). The run trains the same short batch for ``--steps`` optimizer steps (the loss must
fall and stay finite) and reports:

- parameters, bytes on disk, peak RSS (the process high-water mark) against the machine's memory;
- seconds per step split into forward+backward (compute, with the parameter reads and gradient
  writes it waits for) and the optimizer step, and the seconds each waited on the drive
  (swap-in: parameter reads; swap-out: gradient and parameter writes; optimizer records);
- the swap throughput achieved (bytes moved / time) against the drive alone, measured in the same
  run with the same I/O pool (large O_DIRECT requests, reads and writes apart).

``--variants`` runs the same model and batch once per precision, one after the other in this process:
``bf16`` (bf16.cpu_matmul "auto", the default), ``bf16-native`` (torch's bf16 GEMM), ``bf16-fp32mm``
(nn.Linear's products in fp32, bf16 in and out), ``fp32``, ``bf16-states`` (DeepSpeed's
``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``, round to nearest) and ``bf16-states-sr``
(the same with stochastic rounding of the masters); with more than one the report adds their
seconds per step side by side. The report names the CPU: forward+backward is compute-bound on it.

It checks the free space under ``--dir`` first and refuses with what it needs: for the largest
variant, its swap files as ``zengine.estimate`` counts them (parameters + optimizer records per
parameter: fp32 4 + 16, bf16 2 + 16, bf16-states 2 + 8; zero.Init's own file is closed before the
optimizer's opens) and the drive test. Not part of the test
suite (it takes minutes); results go to stdout and ``benchmarks/results/infinity_<date>.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import sys
import time

import torch

from common import REPO, cpu_line, isa_caps, publish, result_path, today

sys.path.insert(0, str(REPO))

import zengine  # noqa: E402
from zengine.estimate import estimate  # noqa: E402
from zengine.models.gpt import GPT, GPTConfig  # noqa: E402
from zengine.ops.aio import AsyncIO, SwapFile, aligned_empty  # noqa: E402

GiB = 1 << 30
# --variants: the precision sections of each ({} = fp32)
VARIANTS = {
    "bf16": {"bf16": {"enabled": True}},
    "bf16-native": {"bf16": {"enabled": True, "cpu_matmul": "native"}},
    "bf16-fp32mm": {"bf16": {"enabled": True, "cpu_matmul": "fp32"}},
    "fp32": {},
    "bf16-states": {
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
        }
    },
    "bf16-states-sr": {
        "bf16": {
            "enabled": True,
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
            "master_rounding": "stochastic",
        }
    },
}


def _disk_bytes(config: dict, n_params: int) -> int:
    """The most bytes a variant has on disk at once: its swap files as ``zengine.estimate`` counts them
    (parameters in the compute dtype, the optimizer's records), or, while ``initialize`` takes the
    parameters over from zero.Init's file (which grows by doubling: up to twice the parameters), the
    engine's parameter file beside that one. zero.Init's file is closed before the optimizer's opens."""
    files = estimate(n_params, config, 1, cpu_training=True).disk
    params = files["parameter swap file"]
    return max(sum(files.values()), params + 2 * params)


def _parameters(layers: int, d: int, vocab: int, seq: int) -> int:
    return layers * (12 * d * d + 13 * d) + vocab * d + seq * d + 2 * d


def _drive_alone(
    directory: str, aio: dict, nbytes: int = 2 * GiB, request: int = 64 << 20
) -> tuple[float, float]:
    """(write GB/s, read GB/s) of the drive with this pool: ``request``-byte O_DIRECT requests, 4 in flight."""
    io = AsyncIO(aio["block_size"], aio["thread_count"], aio["queue_depth"])
    f = SwapFile(directory, nbytes, prefix="zengine-drive-")
    bufs = [aligned_empty(request // 4) for _ in range(4)]
    for b in bufs:
        b.fill_(1.0)
    rates = []
    for write in (True, False):
        began, pending = time.perf_counter(), []
        for k, off in enumerate(range(0, nbytes, request)):
            if len(pending) == len(bufs):
                pending.pop(0).wait()
            b = bufs[k % len(bufs)]
            pending.append(io.write(b, f, off) if write else io.read(b, f, off))
        for r in pending:
            r.wait()
        rates.append(nbytes / (time.perf_counter() - began) / 1e9)
    io.close()
    f.close()
    return rates[0], rates[1]


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _moved(swap) -> tuple[int, int, float]:
    """(bytes read, bytes written, seconds waited) of a swap so far: its I/O pool's counts."""
    stats = swap.io.stats()
    return stats.bytes_read, stats.bytes_written, swap.wait_s


def _swaps(engine):
    opt = engine.optimizer
    return opt.param_swap, opt.optimizer.swapper


def _step_row(engine, x, y, step: int) -> dict:
    """One optimizer step, timed and with the bytes each swap moved and the seconds it waited."""
    pswap, oswap = _swaps(engine)
    p0, o0 = _moved(pswap), _moved(oswap)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = engine(x, y)  # the mean cross-entropy, in fp32
    engine.backward(loss)
    t1, c1 = time.perf_counter(), time.process_time()
    p1, o1 = _moved(pswap), _moved(oswap)
    engine.step()
    t2 = time.perf_counter()
    p2, o2 = _moved(pswap), _moved(oswap)
    moved = (p2[0] - p0[0]) + (p2[1] - p0[1]) + (o2[0] - o0[0]) + (o2[1] - o0[1])
    return {
        "step": step,
        "loss": loss.item(),
        "fwd_bwd_s": t1 - t0,
        "fwd_bwd_cpu_s": c1 - c0,
        "step_s": t2 - t1,
        "swap_in_wait_s": p1[2] - p0[2],
        "grad_out_wait_s": o1[2] - o0[2],
        "opt_io_wait_s": (o2[2] - o1[2]) + (p2[2] - p1[2]),
        "read_gb": ((p2[0] - p0[0]) + (o2[0] - o0[0])) / 1e9,
        "written_gb": ((p2[1] - p0[1]) + (o2[1] - o0[1])) / 1e9,
        "gbps": moved / (t2 - t0) / 1e9,
        "opt_gbps": ((o2[0] - o1[0]) + (o2[1] - o1[1]) + (p2[1] - p1[1])) / (t2 - t1) / 1e9,
        "rss": _peak_rss_gib(),
    }


def _train_variant(
    name: str, config: dict, cfg: GPTConfig, args, x, y
) -> tuple[list[dict], float, int, str]:
    """Build the model under zero.Init, train ``args.steps`` steps; (rows, build seconds, bytes on disk,
    the engine's matmul policy)."""
    torch.manual_seed(0)  # every variant starts from the same initial values
    began = time.perf_counter()
    with zengine.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    built = time.perf_counter() - began
    print(
        f"[{name}] built under zero.Init in {built:.0f} s (peak RSS {_peak_rss_gib():.2f} GiB)",
        flush=True,
    )
    began = time.perf_counter()
    engine, *_ = zengine.initialize(model=model, config=config)
    print(
        f"[{name}] initialize: {time.perf_counter() - began:.0f} s (peak RSS {_peak_rss_gib():.2f} GiB); "
        f"{engine.matmul.describe()}",
        flush=True,
    )
    pswap, oswap = _swaps(engine)
    on_disk = pswap.file.size + oswap.file.size
    rows = []
    for step in range(args.steps):
        row = _step_row(engine, x, y, step + 1)
        rows.append(row)
        print(
            f"[{name}] step {row['step']}: loss {row['loss']:.4f}  fwd+bwd {row['fwd_bwd_s']:.1f} s "
            f"({row['fwd_bwd_cpu_s']:.1f} s of CPU; waited "
            f"{row['swap_in_wait_s']:.1f} s on reads, {row['grad_out_wait_s']:.1f} s on gradient writes)  "
            f"step {row['step_s']:.1f} s (waited {row['opt_io_wait_s']:.1f} s on I/O)  read "
            f"{row['read_gb']:.1f} GB, wrote {row['written_gb']:.1f} GB, {row['gbps']:.2f} GB/s overall, "
            f"optimizer {row['opt_gbps']:.2f} GB/s  peak RSS {row['rss']:.2f} GiB",
            flush=True,
        )
    policy = engine.matmul.describe()
    engine.destroy()
    del engine, model
    return rows, built, on_disk, policy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=2560)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--dir", default="/var/tmp/zengine-infinity")
    ap.add_argument(
        "--variants", default="bf16", help="comma-separated, run in turn: " + ", ".join(VARIANTS)
    )
    ap.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results"), help="folder for the markdown report"
    )
    ap.add_argument(
        "--drive-mib", type=int, default=2048, help="MiB the drive-alone test writes and reads"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a one-layer d_model 64 GPT, two steps, a 16 MiB drive "
        "test: the harness works, the figures mean nothing",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.heads, args.seq, args.steps = 1, 64, 2, 8, 2
        args.lr, args.drive_mib = 1e-3, 16
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants {args.variants!r}: choose from {', '.join(VARIANTS)}")
    vocab = 256
    n_params = _parameters(args.layers, args.d_model, vocab, args.seq)
    drive_bytes = args.drive_mib << 20
    os.makedirs(args.dir, exist_ok=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    aio = {"block_size": 8 << 20, "queue_depth": 8, "thread_count": 2}
    largest = 4 * args.d_model * args.d_model
    base = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "steps_per_print": 10**9,
        "aio": aio,
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 16 << 20,
            "reduce_bucket_size": largest,
            "stage3_prefetch_bucket_size": 2 * largest,
            "stage3_max_live_parameters": 6 * largest,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": args.dir,
                "buffer_count": 6,
                "buffer_size": largest,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": args.dir, "buffer_count": 4},
        },
    }
    # the variants run one after the other, each freeing its files: the largest one's swap files
    # (zengine.estimate's disk bytes), zero.Init's copy of the parameters, and the drive test
    disk = {v: _disk_bytes({**base, **VARIANTS[v]}, n_params) for v in variants}
    need = max(disk.values()) + drive_bytes
    free = shutil.disk_usage(args.dir).free
    if free < need:
        sys.exit(
            f"bench_infinity: {n_params / 1e9:.2f}B parameters need about {need / GiB:.1f} GiB free under "
            f"{args.dir}; there are {free / GiB:.1f} GiB. Free space there, pass --dir on a larger drive, or "
            f"use fewer --layers / a smaller --d-model"
        )
    print(f"drive alone ({args.dir}, 64 MiB O_DIRECT requests, 4 in flight) ...", flush=True)
    drive_w, drive_r = _drive_alone(args.dir, aio, drive_bytes, min(64 << 20, drive_bytes // 4))
    print(f"  write {drive_w:.2f} GB/s, read {drive_r:.2f} GB/s", flush=True)

    cfg = GPTConfig(
        vocab_size=vocab,
        seq_len=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        dropout=0.0,
    )
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    results = {v: _train_variant(v, {**base, **VARIANTS[v]}, cfg, args, x, y) for v in variants}
    drive = 2 / (1 / drive_w + 1 / drive_r)  # reads and writes in equal measure
    command = (
        " ".join(isa_caps() + [f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}"])
        + " python benchmarks/bench_infinity.py "
        f"--layers {args.layers} --d-model {args.d_model} --heads {args.heads} --steps {args.steps} --variants {','.join(variants)}"
    )
    lines = [
        f"# ZeRO-Infinity, {today()}: {n_params / 1e9:.2f}B-parameter GPT on one process",
        "",
        f"`{command}`; {args.layers} layers, d_model {args.d_model}, seq {args.seq}, batch {args.batch}, "
        f"AdamW, stage 3, parameters and optimizer on NVMe ({args.dir}). {cpu_line()} "
        f"torch threads {torch.get_num_threads()}; load average at the end {os.getloadavg()[0]:.1f}.",
        "",
        f"- parameters: {n_params:,} ({n_params * 16 / 1e9:.1f} GB of fp32 params + grads + Adam states; "
        f"machine memory {ram / GiB:.1f} GiB); peak RSS {_peak_rss_gib():.2f} GiB",
        f"- drive alone, same pool: write {drive_w:.2f} GB/s, read {drive_r:.2f} GB/s "
        f"(harmonic mean {drive:.2f} GB/s)",
    ]
    failed = []
    for v, (rows, built, on_disk, policy) in results.items():
        losses = [r["loss"] for r in rows]
        ok = all(math.isfinite(val) for val in losses) and losses[-1] < losses[0]
        failed += [] if ok else [v]
        steady = rows[1:] or rows
        mean_opt = sum(r["opt_gbps"] for r in steady) / len(steady)
        lines += [
            "",
            f"## {v}",
            "",
            f"- {policy}; on disk {on_disk / 1e9:.1f} GB ({on_disk / n_params:.1f} bytes per parameter: "
            f"parameters + optimizer records, padding included; at most {disk[v] / n_params:.0f} "
            f"at once, zero.Init's file included); built under zero.Init in {built:.0f} s",
            f"- loss {' -> '.join(f'{val:.4f}' for val in losses)}: {'falling and finite' if ok else 'NOT falling'}",
            "",
            "| step | loss | fwd+bwd s | fwd+bwd CPU s | waited on reads s | waited on grad writes s | optimizer s | "
            "optimizer I/O wait s | GB read | GB written | GB/s overall | optimizer GB/s | vs drive |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['step']} | {r['loss']:.4f} | {r['fwd_bwd_s']:.1f} | {r['fwd_bwd_cpu_s']:.1f} | "
                f"{r['swap_in_wait_s']:.1f} | "
                f"{r['grad_out_wait_s']:.1f} | {r['step_s']:.1f} | {r['opt_io_wait_s']:.1f} | "
                f"{r['read_gb']:.1f} | {r['written_gb']:.1f} | {r['gbps']:.2f} | {r['opt_gbps']:.2f} | "
                f"{r['opt_gbps'] / drive:.2f} |"
            )
        lines += [
            "",
            f"Optimizer swap after the first step: {mean_opt:.2f} GB/s, {mean_opt / drive:.2f} of the "
            f"drive alone (harmonic mean of its read and write).",
        ]
    if len(results) > 1:
        lines += [
            "",
            "## Side by side (mean over the steps after the first)",
            "",
            "| variant | fwd+bwd s | fwd+bwd CPU s (all threads) | optimizer s | step s | fwd+bwd × first | "
            "fwd+bwd CPU × first |",
            "|---|---|---|---|---|---|---|",
        ]
        first = None
        for v, (rows, *_rest) in results.items():
            steady = rows[1:] or rows
            fb, cpu, opt = (
                sum(r[k] for r in steady) / len(steady)
                for k in ("fwd_bwd_s", "fwd_bwd_cpu_s", "step_s")
            )
            first = (fb, cpu) if first is None else first
            lines.append(
                f"| {v} | {fb:.2f} | {cpu:.2f} | {opt:.2f} | {fb + opt:.2f} | {fb / first[0]:.2f} | "
                f"{cpu / first[1]:.2f} |"
            )
    publish("\n".join(lines) + "\n", result_path(args.out, "infinity"))
    if failed:
        sys.exit(f"bench_infinity: the loss did not fall ({', '.join(failed)})")


if __name__ == "__main__":
    main()
