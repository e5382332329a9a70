"""The tree is as ``ruff format`` writes it (ruff.toml: 100 columns), so that a diff shows changes of
meaning, not of layout. Fails naming the files to format: run ``ruff format`` at the repository root."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["zengine", "tests", "benchmarks", "examples", "setup.py", "zengine_compat_hook.py"]


def _ruff() -> list:
    exe = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(exe):
        pytest.skip("ruff is not installed (the test extra installs it)")
    return [exe]


def test_the_tree_is_formatted():
    run = subprocess.run(
        _ruff() + ["format", "--check", *TARGETS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, (
        "not formatted (run `ruff format` at the repository root):\n"
        + run.stdout[-3000:]
        + run.stderr[-2000:]
    )
