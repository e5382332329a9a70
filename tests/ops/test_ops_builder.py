"""The op builder: cache, file lock, fallback with one warning, ZENGINE_DISABLE_OPS."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from zengine.ops import CPUAdam, load_op
from zengine.ops.builder import OpBuilder, OpState
from zengine.ops.ops import FLATTEN, OpSpec

REPO = Path(__file__).resolve().parents[2]

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on this machine"
)


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter from the repository root; returns the finished process."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def load_counting_warnings(builder: OpBuilder):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = builder.load()
        second = builder.load()
    return first, second, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_no_compiler_falls_back_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    builder = OpBuilder(FLATTEN, cache_root=tmp_path)
    first, second, caught = load_counting_warnings(builder)
    assert first is None and second is None
    assert len(caught) == 1
    message = str(caught[0].message)
    assert (
        "'flatten'" in message
        and "no C++ compiler" in message
        and "torch implementation" in message
    )
    assert builder.status().state is OpState.UNAVAILABLE


@needs_compiler
def test_failed_build_falls_back_with_one_warning(tmp_path):
    (tmp_path / "includes").mkdir()
    (tmp_path / "broken.cpp").write_text("this is not C++;\n")
    spec = OpSpec(name="broken", sources=("broken.cpp",), description="a build that fails")
    builder = OpBuilder(spec, cache_root=tmp_path / "cache", source_root=tmp_path)
    first, second, caught = load_counting_warnings(builder)
    assert first is None and second is None and len(caught) == 1
    message = str(caught[0].message)
    assert "'broken'" in message and "build failed" in message and "error" in message
    assert (tmp_path / "cache" / "broken" / "build_error.log").is_file()


BUILD_AND_REPORT = """
    import json, sys, time
    from pathlib import Path
    from zengine.ops.builder import OpBuilder
    from zengine.ops.ops import FLATTEN
    builder = OpBuilder(FLATTEN, cache_root=Path(sys.argv[1] if len(sys.argv) > 1 else {cache!r}))
    module = builder.load()
    print(json.dumps({{"loaded": module is not None, "compiled": builder.build_seconds is not None,
                       "file": getattr(module, "__file__", None)}}))
"""


@pytest.fixture(scope="module")
def concurrent_cache(tmp_path_factory):
    """Two processes load the flatten op into an empty cache at the same moment."""
    cache = tmp_path_factory.mktemp("ops_cache")
    code = textwrap.dedent(BUILD_AND_REPORT.format(cache=str(cache)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return cache, results


@needs_compiler
def test_concurrent_first_use_builds_once(concurrent_cache):
    cache, results = concurrent_cache
    assert all(r["loaded"] for r in results)
    assert sorted(r["compiled"] for r in results) == [False, True]  # one built, the other waited
    assert results[0]["file"] == results[1]["file"]


@needs_compiler
def test_cached_build_loads_without_a_compiler(concurrent_cache, monkeypatch):
    cache, _ = concurrent_cache
    monkeypatch.setenv("CXX", "/no/such/c++")
    monkeypatch.setenv("PATH", "/nonexistent")  # no ninja either
    builder = OpBuilder(FLATTEN, cache_root=cache)
    assert builder.status().state is OpState.BUILT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = builder.load()
    assert module is not None and builder.build_seconds is None
    flat, parts = torch.empty(5), [torch.ones(2), torch.zeros(3)]
    module.copy_flat(flat.data_ptr(), [t.data_ptr() for t in parts], [8, 12], 0, 1)
    assert flat.tolist() == [1, 1, 0, 0, 0]


STEP_FIVE_TIMES = """
    import warnings, torch
    warnings.simplefilter("always")
    from zengine.ops import CPUAdam
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1003, generator=gen)), torch.nn.Parameter(torch.randn(9, generator=gen))]
    opt = CPUAdam(params, lr=1e-2, weight_decay=0.1)
    out = torch.empty(1003, dtype=torch.bfloat16)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step_with_copy({params[0]: out})
    print(torch.cat([p.detach() for p in params]).view(torch.int32).tolist()[::7])
    print(out.view(torch.int16).tolist()[::7])
"""


def test_disabled_ops_fall_back_to_the_same_results():
    if load_op("cpu_adam") is None:
        pytest.skip("the cpu_adam kernel cannot be built here")
    kernel_out = io.StringIO()
    with contextlib.redirect_stdout(kernel_out):
        exec(textwrap.dedent(STEP_FIVE_TIMES), {})  # here, where the kernel is loaded
    fallback_run = run_python(STEP_FIVE_TIMES, env={"ZENGINE_DISABLE_OPS": "1"})
    assert fallback_run.returncode == 0, fallback_run.stderr
    warned = [line for line in fallback_run.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1 and "'cpu_adam'" in warned[0] and "ZENGINE_DISABLE_OPS" in warned[0]
    assert kernel_out.getvalue() == fallback_run.stdout  # bit for bit, copy-out included


def test_disabling_one_op_by_name(monkeypatch):
    monkeypatch.setenv("ZENGINE_DISABLE_OPS", "flatten, unscale_norm")
    assert OpBuilder(FLATTEN).status().state is OpState.DISABLED
    from zengine.ops.ops import CPU_ADAM

    assert OpBuilder(CPU_ADAM).status().state is not OpState.DISABLED


def test_cpu_adam_steps_device_and_dtype_mismatches_with_torch_ops():
    param = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))  # not fp32: the torch path
    ref = torch.nn.Parameter(param.detach().clone())
    ours, theirs = CPUAdam([param], lr=0.1), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
    for _ in range(3):
        grad = torch.randn(8, dtype=torch.float64)
        param.grad, ref.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(param.detach(), ref.detach(), rtol=0, atol=1e-12)
