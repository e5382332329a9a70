"""Peak resident memory per rank, in units of the fp32 model's bytes, of ZeRO implementations side by side.

    python benchmarks/bench_memory.py [--quick] [--worlds 2,4] [--layers 12] [--width 2048] [--steps 3]
                                      [--contenders zengine-2,ddp,...]

The workload is the one of the memory issue: a stack of ``--layers`` ``nn.Linear(width, width,
bias=False)`` (12 × 2048² = 50.3M parameters by default, so 1 unit = 4 bytes × Ψ = 201 MB), fp32,
AdamW (lr 1e-4), micro batch 2 (``torch.randn(2, width)``, loss ``out.pow(2).mean()``),
reduce_bucket_size = allgather_bucket_size = 5e6, ``--steps`` training steps. Contenders:

- ``zengine-0/1/2/3``: zengine ZeRO stage 0-3; stage 3 with DeepSpeed's default stage-3 settings
  (``zero_contenders.STAGE3``: prefetch bucket 5e7, max live parameters 1e9, max reuse distance 1e9,
  persistence threshold 1e5);
- ``zengine-3-small``: stage 3 with prefetch bucket 5e6, max live 1e7, max reuse distance 1e7,
  persistence threshold 1e5; ``zengine-3-init``: the same, the model built inside ``zengine.zero.Init()``;
- ``zengine-3-lean``: stage 3 with the least memory: no prefetch, max live 5e6 (one layer), max reuse
  distance 0, ``overlap_comm`` false (one bucket reduced at a time); ``zengine-3-lean-init``: the same
  under ``zero.Init()``;
- ``zengine-2-offload``: stage 2, ``offload_optimizer`` cpu; ``zengine-3-offload``: stage 3 small settings,
  ``offload_optimizer`` and ``offload_param`` cpu; ``zengine-3-nvme``: stage 3 small settings,
  ``offload_optimizer`` nvme into a temporary directory (Adam's moments live on disk);
- ``ddp``: torch DistributedDataParallel + torch.optim.AdamW(fused=True), torch's defaults, as a reference;
- ``deepspeed-1/2/3``: DeepSpeed ZeRO (DS_ACCELERATOR=cpu, a client torch fused AdamW, stage 3 with the same
  settings as zengine-3); skipped with a note when ``import deepspeed`` fails.

Every contender runs at every world size (``--worlds``; ``--quick``: 2 only) in fresh processes
(torch.multiprocessing spawn, one gloo process group each, 1 thread per rank).

How a rank measures (Linux only): at process start glibc is told to return freed blocks above 64 KiB
to the system (``mallopt(M_MMAP_THRESHOLD, 65536)``), so that resident memory follows live memory; the
process group is started and one tiny fused AdamW step runs, so that torch's lazy imports (~70 MB) are
done; then the high-water mark VmHWM is reset by writing "5" to /proc/self/clear_refs and the
baseline is the rank's own memory, RssAnon of /proc/self/status (the file-backed library pages that
first use maps are shared by all ranks and vary with the page cache, so they are not counted; the
peak's bound is VmHWM less the shared pages mapped at the reset). After each phase (build the model,
initialize, and per step forward, backward, step) the rank reads (own − baseline, peak − baseline) in
units, then resets the high-water mark, so each phase's peak is its own. The table gives the worst
rank's values.
The table goes to stdout and to ``benchmarks/results/memory_<date>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from common import (
    REPO,
    deepspeed_contenders,
    join_group,
    now,
    publish,
    rank_results,
    result_path,
    save_rank_result,
)

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# Shared with the step-time benchmark: DeepSpeed's default stage-3 settings, the launcher's helpers and
# the tensor counting used for contenders that have no engine.memory_breakdown().
from zero_contenders import STAGE3, optimizer_state_tensors, tensors_reachable, unique_bytes  # noqa: E402

LR = 1e-4
MICRO_BATCH = 2
BUCKET = 5_000_000  # reduce_bucket_size and allgather_bucket_size (elements)
# Stage-3 settings of the "-small" variants: a bounded number of parameters gathered at once.
STAGE3_SMALL = {
    "stage3_prefetch_bucket_size": 5_000_000,
    "stage3_max_live_parameters": 10_000_000,
    "stage3_max_reuse_distance": 10_000_000,
    "stage3_param_persistence_threshold": 100_000,
}
# The "-lean" variants: the least memory stage 3 has, one layer gathered and one bucket reduced at a time.
STAGE3_LEAN = {
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_live_parameters": 5_000_000,
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 100_000,
    "overlap_comm": False,
}
PHASES = ("build", "initialize", "forward", "backward", "step")
M_MMAP_THRESHOLD = -3


# -- the measurement ------------------------------------------------------------------------------
_shared_at_reset = 0  # bytes of shared (file-backed, shm) pages mapped at the last reset_peak()


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in f if ":" in line)
            if v.strip().endswith("kB")
        }


def read_status() -> tuple[int, int]:
    """(own memory now, upper bound of its peak since the last reset_peak()) of this process, in bytes.

    Own memory is the anonymous part of the resident set (tensors, Python objects). The library pages
    that first use faults in are file-backed, shared by every rank and the page cache, and vary with
    the page cache's state, so they are left out; the peak's bound is VmHWM less the shared pages
    mapped at the reset (they only grow while a phase runs)."""
    status = _status()
    return status["RssAnon"], status["VmHWM"] - _shared_at_reset


def reset_peak() -> None:
    """Reset VmHWM to the current resident set and note the shared part of it."""
    global _shared_at_reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    status = _status()
    _shared_at_reset = status["RssFile"] + status["RssShmem"]


class Recorder:
    """Resident memory above a baseline, in units, after each phase; the peak is reset after each reading."""

    def __init__(self, unit: int):
        self.unit = unit
        reset_peak()
        self.base, _ = read_status()
        self.phases: list[
            tuple[str, float, float]
        ] = []  # (phase, own memory after it, peak during it)

    def __call__(self, phase: str) -> None:
        rss, peak = read_status()
        self.phases.append((phase, (rss - self.base) / self.unit, (peak - self.base) / self.unit))
        reset_peak()


# -- the contenders -------------------------------------------------------------------------------
def build_model(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def zengine_config(stage: int, stage3: dict | None = None, **offload) -> dict:
    zero = {
        "stage": stage,
        "reduce_bucket_size": BUCKET,
        "allgather_bucket_size": BUCKET,
        **(stage3 or {}),
        **offload,
    }
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "steps_per_print": 10**9,
        "zero_optimization": zero,
    }


class Contender:
    """How a contender builds its model, wraps it, and trains: ``prepare(model)`` returns
    ``(module, backward, step, counted, teardown)``: ``module(x)`` is the forward, ``backward(loss)``,
    ``step()``, ``counted()`` the bytes of model states it counts, ``teardown()`` its clean end."""

    def __init__(
        self,
        stage: int,
        prepare: Callable,
        formula: Callable[[int], float],
        formula_text: str,
        zero_init: bool = False,
        nvme: bool = False,
    ):
        self.stage, self.prepare, self.formula, self.formula_text = (
            stage,
            prepare,
            formula,
            formula_text,
        )
        self.zero_init, self.nvme = zero_init, nvme


def prepare_zengine(config: Callable[[str | None], dict]):
    """``config(nvme_dir)`` gives the zengine config."""

    def prepare(model: nn.Module, nvme_dir: str | None):
        import zengine
        from zengine.engine.engine import model_state_bytes

        engine, *_ = zengine.initialize(model=model, config=config(nvme_dir))
        return (
            engine,
            engine.backward,
            engine.step,
            lambda: model_state_bytes(engine.memory_breakdown()),
            engine.destroy,
        )

    prepare.config = config  # for zengine.estimate's prediction in the table
    return prepare


def prepare_ddp(model: nn.Module, nvme_dir: str | None):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, fused=True)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def counted():
        params = list(model.parameters())
        return unique_bytes([*params, *(p.grad for p in params), *optimizer_state_tensors(opt)])

    return ddp, lambda loss: loss.backward(), step, counted, lambda: None


def prepare_deepspeed(stage: int, stage3: dict | None):
    def prepare(model: nn.Module, nvme_dir: str | None):
        import deepspeed

        config = {k: v for k, v in zengine_config(stage, stage3).items() if k != "optimizer"}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def counted():
            params = list(engine.module.parameters())
            shards = [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
            return unique_bytes(
                [*params, *shards, *(p.grad for p in params), *tensors_reachable(optimizer)]
            )

        return (
            engine,
            engine.backward,
            engine.step,
            counted,
            getattr(engine, "destroy", lambda: None),
        )

    return prepare


# ZeRO paper's per-rank model states for fp32 Adam, in units of 4Ψ bytes (params 1, grads 1, moments 2).
FORMULAS = {
    0: (lambda w: 4.0, "4"),
    1: (lambda w: 2 + 2 / w, "2+2/W"),
    2: (lambda w: 1 + 3 / w, "1+3/W"),
    3: (lambda w: 4 / w, "4/W"),
}


def contender(stage: int, prepare: Callable, **kw) -> Contender:
    return Contender(stage, prepare, *FORMULAS[stage], **kw)


NVME = {"device": "nvme"}  # nvme_path: a temporary directory per run, filled in by the launcher
CONTENDERS: dict[str, Contender] = {
    "zengine-0": contender(0, prepare_zengine(lambda d: zengine_config(0))),
    "zengine-1": contender(1, prepare_zengine(lambda d: zengine_config(1))),
    "zengine-2": contender(2, prepare_zengine(lambda d: zengine_config(2))),
    "zengine-3": contender(3, prepare_zengine(lambda d: zengine_config(3, STAGE3))),
    "zengine-3-small": contender(3, prepare_zengine(lambda d: zengine_config(3, STAGE3_SMALL))),
    "zengine-3-init": contender(
        3, prepare_zengine(lambda d: zengine_config(3, STAGE3_SMALL)), zero_init=True
    ),
    "zengine-3-lean": contender(3, prepare_zengine(lambda d: zengine_config(3, STAGE3_LEAN))),
    "zengine-3-lean-init": contender(
        3, prepare_zengine(lambda d: zengine_config(3, STAGE3_LEAN)), zero_init=True
    ),
    "zengine-2-offload": contender(
        2, prepare_zengine(lambda d: zengine_config(2, offload_optimizer={"device": "cpu"}))
    ),
    "zengine-3-offload": contender(
        3,
        prepare_zengine(
            lambda d: zengine_config(
                3,
                STAGE3_SMALL,
                offload_optimizer={"device": "cpu"},
                offload_param={"device": "cpu"},
            )
        ),
    ),
    # Adam's moments on disk: 2/W units stay in memory (parameter and gradient shards), plus swap buffers.
    "zengine-3-nvme": Contender(
        3,
        prepare_zengine(
            lambda d: zengine_config(3, STAGE3_SMALL, offload_optimizer={**NVME, "nvme_path": d})
        ),
        lambda w: 2 / w,
        "2/W (moments on disk)",
        nvme=True,
    ),
    "ddp": contender(0, prepare_ddp),
    "deepspeed-1": contender(1, prepare_deepspeed(1, None)),
    "deepspeed-2": contender(2, prepare_deepspeed(2, None)),
    "deepspeed-3": contender(3, prepare_deepspeed(3, STAGE3)),
}


# -- one rank -------------------------------------------------------------------------------------
def worker(
    rank: int, world: int, port: int, name: str, args: dict, nvme_dir: str | None, out_dir: str
) -> None:
    ctypes.CDLL("libc.so.6").mallopt(
        M_MMAP_THRESHOLD, 65536
    )  # freed large blocks go back to the system
    result: dict = {"rank": rank}
    teardown = None
    try:
        # A rank that fails leaves its peers in a collective: time out rather than hang the launcher.
        join_group(rank, world, port, minutes=5, ZENGINE_DEVICE="cpu")
        if name.startswith(("zengine", "deepspeed")):
            __import__(name.split("-")[0])  # the library's own import is not the training's memory
        torch.optim.AdamW(
            [nn.Parameter(torch.ones(2))], fused=True
        ).step()  # torch's lazy imports, before the baseline
        numel = args["layers"] * args["width"] ** 2
        record = Recorder(unit=4 * numel)
        spec = CONTENDERS[name]

        torch.manual_seed(0)
        if spec.zero_init:
            import zengine

            with zengine.zero.Init():
                model = build_model(args["layers"], args["width"])
        else:
            model = build_model(args["layers"], args["width"])
        record("build")
        module, backward, step, counted, teardown = spec.prepare(model, nvme_dir)
        record("initialize")
        counted_bytes = 0
        for i in range(args["steps"]):
            loss = module(torch.randn(MICRO_BATCH, args["width"])).pow(2).mean()
            record("forward")
            backward(loss)
            record("backward")
            if (
                i == args["steps"] - 1
            ):  # grads and optimizer states both alive (read after the backward's peak)
                counted_bytes = counted()
            step()
            record("step")
        result.update(
            phases=record.phases,
            counted=counted_bytes / record.unit,
            numel=numel,
            loss=loss.item(),
            base_mb=record.base / 2**20,
        )
    except Exception:
        result["error"] = traceback.format_exc(limit=8)
    # Written before the teardown: a failure at exit does not lose the measurements.
    save_rank_result(out_dir, rank, result)
    if "error" not in result:
        teardown()
        dist.barrier()
        dist.destroy_process_group()


# -- the launcher ---------------------------------------------------------------------------------
def code_state() -> str:
    """The commit measured and, when zengine/ has uncommitted changes, the files and a digest of the diff."""

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(
                ["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    diff = git("diff", "HEAD", "--", "zengine")
    if not diff:
        return f"commit {head}"
    files = git("diff", "HEAD", "--name-only", "--", "zengine").split()
    return f"commit {head} + uncommitted changes to {', '.join(files)} (diff {hashlib.sha1(diff.encode()).hexdigest()[:8]})"


def run_contender(name: str, world: int, args: argparse.Namespace) -> list[dict]:
    nvme_dir = (
        tempfile.mkdtemp(prefix="zengine_bench_memory_nvme_") if CONTENDERS[name].nvme else None
    )
    try:
        sizes = {"layers": args.layers, "width": args.width, "steps": args.steps}
        results = rank_results(worker, world, name, sizes, nvme_dir, label=f"{name} W={world}")
    finally:
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return results


def predicted(spec: "Contender", args: argparse.Namespace, world: int) -> str:
    """zengine.estimate's peak (model states + the step's transients) in units, for zengine contenders."""
    config = getattr(spec.prepare, "config", None)
    if config is None:
        return ""
    from zengine.estimate import estimate

    est = estimate(
        [args.width * args.width] * args.layers,
        config(tempfile.gettempdir()),
        world,
        cpu_training=True,
    )
    return f"{(est.peak_device + est.host_states) / (4 * args.layers * args.width**2):.2f}"


def summarize(
    runs: dict[tuple[str, int], list[dict]],
    args: argparse.Namespace,
    notes: list[str],
    seconds: float,
    code: str,
) -> str:
    numel = args.layers * args.width**2
    table = [
        "| contender | W | formula | counted | after steps | peak | peak / formula | peak − formula "
        "| estimate | build | initialize | forward | backward | step | peak per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
    worst: list[tuple[float, str]] = []
    for (name, world), ranks in runs.items():
        spec = CONTENDERS[name]
        formula = spec.formula(world)
        formula_cell = f"{formula:.2f} ({spec.formula_text})"
        error = next((r["error"] for r in ranks if "error" in r), None)
        if error is not None:
            table.append(f"| {name} | {world} | {formula_cell} | failed |" + " |" * 11)
            failures.append(f"- {name} W={world} failed:\n\n```\n{error.strip()}\n```")
            continue
        peaks = [max(p for _, _, p in r["phases"]) for r in ranks]
        peak = max(peaks)
        after = max(r["phases"][-1][1] for r in ranks)
        counted = max(r["counted"] for r in ranks)
        by_phase = {
            k: max(p for r in ranks for kind, _, p in r["phases"] if kind == k) for k in PHASES
        }
        worst_phase = max(by_phase, key=by_phase.get)
        worst.append(
            (
                peak - formula,
                f"{name} W={world}: peak {peak:.2f} in {worst_phase}, "
                f"{peak - formula:+.2f} over the formula {formula:.2f}",
            )
        )
        table.append(
            f"| {name} | {world} | {formula_cell} | {counted:.2f} | {after:.2f} | {peak:.2f} "
            f"| {peak / formula:.2f} | {peak - formula:+.2f} | {predicted(spec, args, world)} | "
            + " | ".join(f"{by_phase[k]:.2f}" for k in PHASES)
            + " | "
            + "/".join(f"{p:.2f}" for p in peaks)
            + " |"
        )
    worst.sort(reverse=True)
    header = [
        f"# Peak resident memory per rank, {now()}",
        "",
        f"Model: {args.layers} × nn.Linear({args.width}, {args.width}, bias=False), Ψ = {numel:,} parameters, fp32; "
        f"1 unit = 4Ψ bytes = {4 * numel / 1e6:.1f} MB. AdamW lr {LR}, micro batch {MICRO_BATCH} "
        f"(torch.randn({MICRO_BATCH}, {args.width}), loss out.pow(2).mean()), {args.steps} steps; "
        f"reduce_bucket_size = allgather_bucket_size = {BUCKET:,}; gloo ranks × 1 thread each, on "
        f"{os.cpu_count()} CPUs. zengine-3: "
        + ", ".join(f"{k} {v:,}" for k, v in STAGE3.items())
        + " (DeepSpeed's defaults); -small, -init, -offload, -nvme: "
        + ", ".join(f"{k} {v:,}" for k, v in STAGE3_SMALL.items())
        + ".",
        "",
        "All values in units, above a baseline taken after the process group and torch's lazy imports, "
        "with mallopt(M_MMAP_THRESHOLD, 65536). Worst rank of each run. formula: the ZeRO paper's model "
        "states per rank for fp32 Adam (1 unit each of parameters and gradients, 2 of Adam's moments; "
        "stage 0 and DDP 4, stage 1 2+2/W, stage 2 1+3/W, stage 3 4/W; with the CPU as the device, CPU "
        "offload changes nothing). counted: the model-state tensors the contender holds between the last "
        "backward and step (zengine: model_state_bytes(engine.memory_breakdown()), its kinds summed; DDP: parameters, gradients and "
        "AdamW states). after steps: own memory (RssAnon) after the last step. peak: its high-water mark over the whole run (VmHWM less the shared library pages); build ... step: "
        "the peak during that kind of phase (forward, backward, step: the highest of the steps). "
        "peak per rank: each rank's peak. estimate: `zengine.estimate` before training (model states on "
        "device and host, which are the same memory here, plus the step's transients: autograd's gradient "
        "of the largest parameter, gradient buckets in flight, stage-3 live parameters and prefetch).",
        "",
        f"torch {torch.__version__}, Python {platform.python_version()}; {seconds:.0f} s for the whole run, "
        f"load average at the end {os.getloadavg()[0]:.1f}. zengine: {code}.",
        "",
    ]
    lines = ["", "Notes:", ""] + notes
    if worst:
        lines.append(
            "- Largest peak over the formula: " + "; ".join(text for _, text in worst[:3]) + "."
        )
    lines += [
        "- ddp: torch's defaults (gradient_as_bucket_view=False, so DDP's reducer buckets are a second "
        "copy of the gradients; zero_grad(set_to_none=True) after each step).",
        "- zengine-3-nvme: Adam's moments are swapped to a temporary directory, so its formula leaves "
        "them out (2/W: parameter and gradient shards); the swap buffers come on top.",
    ]
    return "\n".join(header + table + lines + failures) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="nn.Linear layers")
    parser.add_argument("--width", type=int, default=2048, help="in and out features of each layer")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (gloo ranks)")
    parser.add_argument("--quick", action="store_true", help="world size 2 only")
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="comma-separated subset of " + ", ".join(CONTENDERS),
    )
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results"), help="folder for the markdown table"
    )
    args = parser.parse_args(argv)
    worlds = [2] if args.quick else [int(w) for w in args.worlds.split(",") if w.strip()]
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    if not sys.platform.startswith("linux"):
        parser.error("the measurement reads /proc/self/status and glibc's mallopt: Linux only")

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names, notes = deepspeed_contenders(
        names,
        "ZeRO with a client torch fused AdamW; counted: its parameters "
        "(and stage-3 partitions), gradients and every tensor reachable from its "
        "ZeRO optimizer.",
    )

    start, code = time.perf_counter(), code_state()
    runs: dict[tuple[str, int], list[dict]] = {}
    for name in names:
        for world in worlds:
            t0 = time.perf_counter()
            runs[name, world] = results = run_contender(name, world, args)
            status = (
                "error"
                if any("error" in r for r in results)
                else f"peak {max(p for r in results for _, _, p in r['phases']):.2f} units"
            )
            print(
                f"{name} W={world}: {status} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    if code_state() != code:
        notes.append(
            f"- zengine's code changed during the run (now {code_state()}): the rows mix code states."
        )
    publish(
        summarize(runs, args, notes, time.perf_counter() - start, code),
        result_path(args.out, "memory"),
    )


if __name__ == "__main__":
    main()
