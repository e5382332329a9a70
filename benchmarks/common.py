"""The harness every benchmark shares: gloo ranks in fresh processes, where results go and how
they are named, and what machine and code a report describes.

    spawn_ranks(fn, world, *args)          # fn(rank, world, port, *args) in `world` processes
    rows = rank_results(fn, world, *args)  # fn(rank, world, port, *args, folder) saves its dict
    write_result(text, result_path(out, "zero"))   # benchmarks/results/zero_YYYY-MM-DD.md

Ranks start by ``spawn`` (a fresh interpreter: what a rank's memory and import time count starts
from nothing). ``BENCH_START_METHOD=forkserver`` starts them from a server that imported torch
once instead: the smoke test's one-step runs, where only the rows matter, not the figures.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
START_METHOD_VARIABLE = "BENCH_START_METHOD"


# -- when and where -------------------------------------------------------------------------------
def today() -> str:
    """Today as results files name it: YYYY-MM-DD."""
    return datetime.date.today().isoformat()


def now() -> str:
    """The date and minute a report's title gives: YYYY-MM-DD HH:MM."""
    return f"{datetime.datetime.now():%Y-%m-%d %H:%M}"


def result_path(out: Optional[str], stem: str, ext: str = "md") -> Path:
    """``<out or benchmarks/results>/<stem>_<YYYY-MM-DD>.<ext>``: a folder's dated results file."""
    return Path(out or RESULTS) / f"{stem}_{today()}.{ext}"


def write_result(text: str, path: Path, out_file: Optional[str] = None) -> Path:
    """Write a report to ``out_file`` when given, else to ``path``; say where on stderr."""
    target = Path(out_file) if out_file else Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    print(f"written to {target}", file=sys.stderr)
    return target


def publish(text: str, path: Path, out_file: Optional[str] = None) -> Path:
    """Print a report, then write it as ``write_result`` does."""
    print(text)
    return write_result(text, path, out_file)


def command_line(script: str, argv: Optional[list[str]] = None) -> str:
    """This run's command (``argv``: its arguments, the process's by default), with the variables
    that cap the CPU's instruction sets in front."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(isa_caps() + ["python", f"benchmarks/{script}", *args])


# -- gloo ranks -----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port nobody listens on now, for a rendezvous on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The variables ``torch.distributed``'s env:// rendezvous reads, for rank ``rank``."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        **extra,
    }


def join_group(
    rank: int, world: int, port: int, minutes: Optional[float] = None, **env: str
) -> None:
    """This process as gloo rank ``rank`` of ``world`` with one compute thread (``env``: more
    variables to set first). ``minutes``: how long a collective may wait, so that a rank whose
    peer failed times out rather than hangs the launcher (torch's default when None)."""
    import torch
    import torch.distributed as dist

    os.environ.update(rank_env(rank, world, port, **env))
    torch.set_num_threads(1)
    timeout = {} if minutes is None else {"timeout": datetime.timedelta(minutes=minutes)}
    dist.init_process_group("gloo", rank=rank, world_size=world, **timeout)


def start_method() -> str:
    """How rank processes start: ``spawn`` unless ``BENCH_START_METHOD`` says otherwise."""
    method = os.environ.get(START_METHOD_VARIABLE, "spawn")
    if method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(["torch"])
    return method


def spawn_ranks(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` fresh processes and wait for them all;
    a rank that fails raises here."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _in_environ,
        args=(dict(os.environ), fn, world, free_port(), *args),
        nprocs=world,
        join=True,
        start_method=start_method(),
    )


def _in_environ(rank: int, environ: dict, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(rank, *args)`` under the launcher's environment."""
    _take_environ(environ)
    return fn(rank, *args)


def _take_environ(environ: dict) -> None:
    """The launcher's environment as it was at the start: a forkserver's process would otherwise
    have the server's, from when the server started."""
    os.environ.clear()
    os.environ.update(environ)


def rank_results(fn: Callable[..., None], world: int, *args: Any, label: str = "") -> list[dict]:
    """Run ``fn(rank, world, port, *args, folder)`` in ``world`` processes, each saving its result
    with ``save_rank_result(folder, rank, result)``; the results by rank. A rank that crashed
    before saving reads ``{"rank": r, "error": "no result"}``: the others' figures are kept."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            spawn_ranks(fn, world, *args, folder)
        except Exception as err:  # a crashed process: keep what the others wrote
            print(f"  {label}: a worker failed: {err}", file=sys.stderr)
        return [
            json.loads(path.read_text()) if path.exists() else {"rank": r, "error": "no result"}
            for r, path in ((r, Path(folder, f"{r}.json")) for r in range(world))
        ]


def save_rank_result(folder: str, rank: int, result: dict) -> None:
    """A rank's result, for ``rank_results`` to collect."""
    Path(folder, f"{rank}.json").write_text(json.dumps(result))


def slowest_rank(values: list[float]) -> list[float]:
    """Per entry, the largest of every rank's ``values`` (a step ends when the slower rank's
    does)."""
    import torch
    import torch.distributed as dist

    most = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return most.tolist()


def mean_over_ranks(value: float) -> float:
    """``value`` averaged over the ranks (in float64)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def one_process(fn: Callable[..., Any], *args: Any, label: str = "", timeout: float = 600.0) -> Any:
    """``fn(*args)`` in one fresh process (started as ranks are); its value, or its error raised
    here with the process's traceback (``label``: what failed, in the message)."""
    ctx = multiprocessing.get_context(start_method())
    queue = ctx.Queue()
    proc = ctx.Process(target=_report_to, args=(queue, dict(os.environ), fn, args))
    proc.start()
    ok, value = queue.get(timeout=timeout)
    proc.join(timeout=30)
    if not ok:
        raise RuntimeError(f"{label or getattr(fn, '__name__', fn)} failed:\n{value}")
    return value


def _report_to(queue: Any, environ: dict, fn: Callable[..., Any], args: tuple) -> None:
    _take_environ(environ)
    try:
        queue.put((True, fn(*args)))
    except BaseException as error:  # report it to the parent instead of hanging it
        import traceback

        queue.put((False, f"{error!r}\n{traceback.format_exc()}"))


# -- the machine and the code ---------------------------------------------------------------------
def cpu_line() -> str:
    """The CPU model, its bf16-relevant flags, and any variable that caps the ISA torch's kernels
    use."""
    import torch

    from zengine.precision.cpu_matmul import choose_matmul_policy, cpu_flags

    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # the model name, and the family/model numbers a VM's
        # name may hide
        first = open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
        info = dict(line.split(":", 1) for line in first if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        model = (
            f"{info.get('model name', model)}, family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}"
        )
    flags = (
        " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
        or "none known"
    )
    caps = " ".join(isa_caps())
    auto = choose_matmul_policy("auto", torch.bfloat16, torch.device("cpu"))
    return (
        f"CPU: {model} ({flags}){'; ISA capped by ' + caps if caps else ''}; "
        f"bf16.cpu_matmul \"auto\" here: {auto.mode}."
    )


def isa_caps() -> list[str]:
    """``NAME=value`` of the set variables that cap the instruction sets torch's CPU kernels use
    (set them to measure an AVX2 CPU's bf16 on a newer one: ONEDNN_MAX_CPU_ISA=AVX2
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2)."""
    return [
        f"{k}={os.environ[k]}"
        for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
        if k in os.environ
    ]


def deepspeed_contenders(names: list[str], note: str) -> tuple[list[str], list[str]]:
    """``names`` and the report's notes: DeepSpeed's version and ``note`` when it imports, else its
    contenders left out and a note saying why."""
    if not any(n.startswith("deepspeed") for n in names):
        return names, []
    ok, info = deepspeed_status()
    if ok:
        return names, [f"- DeepSpeed {info} (DS_ACCELERATOR=cpu), {note}"]
    return (
        [n for n in names if not n.startswith("deepspeed")],
        [f"- DeepSpeed skipped: `import deepspeed` failed ({info})."],
    )


def deepspeed_status() -> tuple[bool, str]:
    """Whether ``import deepspeed`` works in a fresh process, and its version or error."""
    proc = subprocess.run(
        [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=300,
    )
    if proc.returncode == 0:
        return True, proc.stdout.strip().splitlines()[-1]
    return False, (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
