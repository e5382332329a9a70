"""One switch for every process (issue 46 item 1): with ``ZENGINE_DEEPSPEED_COMPAT`` set, any Python
process of the environment zengine is installed in, started by whoever, resolves ``deepspeed`` to zengine
from its first import; unset, nothing changes; a real DeepSpeed is never shadowed. The hook is the
``zengine-deepspeed-compat.pth`` line pip installs (setup.py) and ``zengine_compat_hook.arm``."""

import os
import site
import subprocess
import sys

import pytest

import zengine
import zengine_compat_hook
from zengine.compat import DEEPSPEED_VERSION

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zengine.__file__)))
PTH = "zengine-deepspeed-compat.pth"

_ASK = (
    "import importlib.metadata as md, importlib.util as iu, sys\n"
    "print('light', 'zengine' in sys.modules)\n"
    "try:\n    print('version', md.version('deepspeed'))\n"
    "except md.PackageNotFoundError:\n    print('version none')\n"
    "print('spec', iu.find_spec('deepspeed') is not None)\n"
    "import deepspeed\nprint('module', deepspeed.__name__)\n"
)


def _run(code: str, value, extra_path: str = None) -> subprocess.CompletedProcess:
    """A plain ``python -c`` child, as any tool would start it: only the environment differs."""
    env = {k: v for k, v in os.environ.items() if k != "ZENGINE_DEEPSPEED_COMPAT"}
    if value is not None:
        env["ZENGINE_DEEPSPEED_COMPAT"] = value
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [extra_path, PACKAGE_ROOT, env.get("PYTHONPATH")] if p
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )


def _site_dirs() -> list:
    return site.getsitepackages() + [site.getusersitepackages()]


def test_the_hook_is_installed_beside_zengine():
    """pip put the .pth line in site-packages (editable installs too: setup.py's BuildPyWithData)."""
    found = [d for d in _site_dirs() if os.path.isfile(os.path.join(d, PTH))]
    assert found, f"{PTH} is in none of {_site_dirs()}: reinstall zengine (pip install -e .)"
    with open(os.path.join(found[0], PTH)) as f:
        line = f.read()
    assert line.startswith("import ") and "ZENGINE_DEEPSPEED_COMPAT" in line and "arm()" in line


@pytest.mark.parametrize("value", ["1", "true"])
def test_any_process_gets_deepspeed_from_the_variable_alone(value):
    run = _run(_ASK, value)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    # nothing of zengine (nor torch) is imported until the process asks for DeepSpeed
    assert lines == [
        "light False",
        f"version {DEEPSPEED_VERSION}",
        "spec True",
        "module zengine",
    ], run.stdout


@pytest.mark.parametrize("value", [None, "0", ""])
def test_without_the_variable_nothing_changes(value):
    run = _run(_ASK.replace("import deepspeed\nprint('module', deepspeed.__name__)\n", ""), value)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["light False", "version none", "spec False"], run.stdout


def test_a_real_deepspeed_is_not_shadowed(tmp_path):
    fake = tmp_path / "deepspeed"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    run = _run(
        "import deepspeed; print('real', getattr(deepspeed, 'REAL', False))", "1", str(tmp_path)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "real True"
    assert "a real DeepSpeed is installed" in run.stderr and str(fake) in run.stderr


def test_wanted_reads_the_usual_spellings():
    assert all(
        zengine_compat_hook.wanted({"ZENGINE_DEEPSPEED_COMPAT": v})
        for v in ("1", "true", "Yes", " on ")
    )
    assert not any(
        zengine_compat_hook.wanted({"ZENGINE_DEEPSPEED_COMPAT": v}) for v in ("", "0", "no")
    )
    assert not zengine_compat_hook.wanted({})
