"""Every benchmark for one step, so that none rots unnoticed: each runs at its smallest (``--smoke``
or tiny arguments) into a temporary folder, and its report must hold a result row per contender.

The figures are not checked (one step on a busy machine measures nothing); that the rows are
there, and none says "failed", is. Ranks start from a forkserver that imported torch once
(``BENCH_START_METHOD``), not a fresh interpreter each: the rows need no clean memory baseline.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script as a module; the variables its ``main`` sets are undone after."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("BENCH_START_METHOD", "forkserver")
    saved = dict(os.environ)
    yield importlib.import_module
    os.environ.clear()
    os.environ.update(saved)


def table_rows(path: Path) -> dict[str, str]:
    """The rows of the markdown tables in ``path``, by their first cell (header rows included)."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.setdefault(line.split("|")[1].strip(), line)
    return rows


def report(folder: Path) -> Path:
    """The one markdown report a benchmark wrote into ``folder``."""
    found = sorted(folder.glob("*.md"))
    assert len(found) == 1, f"expected one report in {folder}, found {[p.name for p in found]}"
    return found[0]


def assert_rows(path: Path, names: list[str]) -> None:
    rows = table_rows(path)
    for name in names:
        assert name in rows, f"no row for {name!r} in {path.name}; rows: {list(rows)}"
        assert "failed" not in rows[name], rows[name]


def test_adam(bench, tmp_path):
    out = tmp_path / "adam.md"
    bench("bench_adam").main(
        ["--sizes", "4K", "--rounds", "1", "--no-deepspeed", "--out", str(out)]
    )
    assert_rows(
        out,
        [
            "zengine CPUAdam (AdamW)",
            "torch AdamW fused",
            "torch Adam default",
            "zengine CPUAdam + bf16 copy-out (one pass)",
        ],
    )


def test_quantize(bench, tmp_path):
    out = tmp_path / "quantize.md"
    bench("bench_quantize").main(["--numel", "4K", "--rounds", "1", "--out", str(out)])
    assert len(table_rows(out)) > 1


def test_swap(bench, tmp_path):
    out = tmp_path / "swap.md"
    bench("bench_swap").main(
        [
            "--params",
            "256K",
            "--sub-group",
            "64K",
            "--buffers",
            "2",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--dir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    assert_rows(out, ["CPUAdam, moments in memory"])
    assert any(name.startswith("SwappedAdam") for name in table_rows(out))


def test_activation(bench, tmp_path):
    bench("bench_activation").main(
        [
            "--layers",
            "1",
            "--width",
            "32",
            "--heads",
            "2",
            "--seq",
            "16",
            "--batch",
            "2",
            "--vocab",
            "64",
            "--steps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert_rows(report(tmp_path), ["none", "checkpoint", "checkpoint+cpu"])


def test_checkpoint(bench, tmp_path):
    bench("bench_checkpoint").main(
        [
            "--width",
            "64",
            "--layers",
            "1",
            "--world",
            "1",
            "--rounds",
            "1",
            "--export-layers",
            "1",
            "--dir",
            str(tmp_path),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert_rows(
        report(tmp_path / "out"),
        ["save_checkpoint (1 ranks)", "load_checkpoint (1 ranks, cold)", "1"],
    )


def test_comm(bench, tmp_path):
    bench("bench_comm").main(
        ["--world", "2", "--per-node", "1", "--steps", "1", "--stages", "1", "--out", str(tmp_path)]
    )
    assert_rows(report(tmp_path), ["1"])


def test_compile(bench, tmp_path):
    bench("bench_compile").main(
        ["--smoke", "--world", "1", "--contenders", "zengine-2-compiled", "--out", str(tmp_path)]
    )
    assert_rows(report(tmp_path), ["zengine-2-compiled"])


def test_memory(bench, tmp_path):
    bench("bench_memory").main(
        [
            "--layers",
            "2",
            "--width",
            "64",
            "--steps",
            "1",
            "--worlds",
            "1",
            "--contenders",
            "zengine-2",
            "--out",
            str(tmp_path),
        ]
    )
    assert_rows(report(tmp_path), ["zengine-2"])


def test_shm(bench, tmp_path):
    bench("bench_shm").main(
        [
            "--world",
            "2",
            "--sizes",
            "1",
            "--repeats",
            "3",
            "--piece",
            "0.25",
            "--out",
            str(tmp_path),
        ]
    )
    lines = report(tmp_path).read_text().splitlines()
    assert sum(line.startswith("| 1 |") for line in lines) == 3  # three collectives at 1 MiB


def test_gather_units(bench, tmp_path):
    bench("bench_gather_units").main(
        ["--world", "2", "--model", "tiny", "--warmup", "1", "--steps", "2", "--rounds", "1"]
        + ["--contenders", "auto,module,leaf-blocks", "--out", str(tmp_path)]
    )
    lines = report(tmp_path).read_text().splitlines()
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| ")][1:] == [
        "auto",
        "module",
        "leaf-blocks",
    ]


def test_device_memory(bench, tmp_path):
    out = tmp_path / "device_memory.md"
    bench("bench_device_memory").main(
        [
            "--worlds",
            "2",
            "--layers",
            "1",
            "--d_model",
            "64",
            "--contenders",
            "auto,fsdp2",
            "--out",
            str(out),
        ]
    )
    lines = out.read_text().splitlines()
    rows = [line for line in lines if line.startswith("| auto")]  # side by side, then the detail
    fsdp2 = [line for line in lines if line.startswith("| fsdp2")]
    assert len(rows) == 2 and float(rows[0].split("|")[2]) > 0, rows
    assert len(fsdp2) == 1 and rows[0].split("|")[6].strip().endswith("x"), fsdp2


def test_zero(bench, tmp_path):
    bench("bench_zero").main(
        ["--smoke", "--world", "2", "--contenders", "zengine-2", "--out", str(tmp_path)]
    )
    assert_rows(report(tmp_path), ["zengine-2"])


def test_zero_deepspeed(bench, tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed's contenders need it installed")
    bench("bench_zero").main(
        ["--smoke", "--world", "1", "--contenders", "deepspeed-2", "--out", str(tmp_path)]
    )
    assert_rows(report(tmp_path), ["deepspeed-2"])


def test_infinity(tmp_path):
    # Its own process: it trains in this one (a process group of one, zengine's own).
    run = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_infinity.py"),
            "--smoke",
            "--dir",
            str(tmp_path / "swap"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert_rows(report(tmp_path), ["1", "2"])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bench_gpu measures a CUDA device; none here"
)
def test_gpu(bench, tmp_path):
    bench("bench_gpu").main(
        [
            "--layers",
            "1",
            "--d_model",
            "64",
            "--heads",
            "2",
            "--seq",
            "16",
            "--vocab",
            "256",
            "--micro_batch",
            "2",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--contenders",
            "torch,zengine-2",
            "--out",
            str(tmp_path),
        ]
    )
    assert_rows(report(tmp_path), ["torch", "zengine-2"])


def test_gpu_partial_offload_rows_on_cpu(bench, tmp_path):
    # bench_gpu's CPU smoke run (gloo) of partial offload's rows, so that the next GPU run measures them
    rows = ["zengine-3-offload-r1.0", "zengine-3-offload-r0.5", "zengine-3-offload-r0.0"]
    tiny = ["--layers", "1", "--d_model", "64", "--heads", "2", "--seq", "16", "--vocab", "256"]
    bench("bench_gpu").main(
        ["--device", "cpu", *tiny, "--micro_batch", "2", "--warmup", "0", "--steps", "1"]
        + ["--contenders", ",".join(rows), "--out", str(tmp_path)]
    )
    assert_rows(report(tmp_path), rows)
    # each offload row set against its bound (offload_bound.py), in the report and the JSON
    bounds = report(tmp_path).read_text().split("Offload rows against their bound", 1)[1]
    assert all(f"| {row} |" in bounds for row in rows), bounds
    results = json.loads(next(tmp_path.glob("gpu_cpu_*.json")).read_text())
    host = {r["name"]: r["bound"]["host_adam_s"] for r in results}
    assert host["zengine-3-offload-r0.0"] == 0.0 < host["zengine-3-offload-r0.5"]
    assert host["zengine-3-offload-r1.0"] == pytest.approx(2 * host["zengine-3-offload-r0.5"])


def test_bf16_masters(bench, tmp_path):
    bench("bench_bf16_masters").main(
        ["--steps", "2", "--micro", "2", "--parallel", "--out", str(tmp_path)]
    )
    rows = table_rows(report(tmp_path))
    for mode in ("fp32", "nearest", "kahan", "stochastic"):
        assert mode in rows and "did not run" not in rows[mode], rows
