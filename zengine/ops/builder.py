"""Build and load the compiled ops declared in ``ops.py``.

How an op is found, in order (``OpBuilder.load``):

1. ``ZENGINE_DISABLE_OPS`` names it (``1``/``all``, or a comma list of op names): not loaded.
2. Prebuilt: the module ``zengine.ops._<name>`` that ``ZENGINE_BUILD_OPS=1 pip install .`` made.
3. Cached: a just-in-time build in ``<cache>/<torch version>/<name>`` whose stamp matches the
   current sources, flags, torch and Python; imported directly, no compiler is run.
4. Built now with ninja through ``torch.utils.cpp_extension.load``, under a file lock so that
   when several ranks start at once one builds and the others wait, then import the result.

``<cache>`` is ``$ZENGINE_OPS_CACHE``, else ``$XDG_CACHE_HOME/zengine/ops`` (``~/.cache``).
When none of this works (no compiler, no ninja, sources not shipped, a failed build) ``load``
returns None after ONE ``RuntimeWarning`` naming the op and the reason, and the caller uses
its torch implementation of the same math.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType

from .ops import ALL_OPS, OpSpec

__all__ = [
    "OpBuilder",
    "OpState",
    "OpStatus",
    "get_builder",
    "load_op",
    "build_all",
    "csrc_dir",
    "cache_dir",
]

log = logging.getLogger("zengine.ops")

_STAMP = "zengine_stamp.json"


class OpState(Enum):
    """Where an op stands in this process and on this machine."""

    PREBUILT = "prebuilt"  # installed with ZENGINE_BUILD_OPS=1
    BUILT = "built"  # in the JIT cache, up to date
    BUILDABLE = "can be built"  # not built yet; compiler, ninja and sources present
    DISABLED = "disabled"  # ZENGINE_DISABLE_OPS names it
    UNAVAILABLE = "unavailable"  # cannot be built here, or its build failed


@dataclass(frozen=True)
class OpStatus:
    state: OpState
    detail: str  # a path, or the reason it is unavailable


def csrc_dir() -> Path | None:
    """The ``csrc/`` folder: beside the package in a source checkout, or shipped inside it."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[1] / "csrc", here / "csrc"):
        if (candidate / "includes").is_dir():
            return candidate
    return None


def cache_dir() -> Path:
    """Root of the JIT build cache for this torch version."""
    import torch

    root = os.environ.get("ZENGINE_OPS_CACHE")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zengine" / "ops"
    return base / torch.__version__


def _disabled_by_env(name: str) -> bool:
    value = os.environ.get("ZENGINE_DISABLE_OPS", "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "all", "true", "yes"):
        return True
    return name in {item.strip() for item in value.split(",")}


def _compiler() -> str:
    """The C++ compiler torch's extension tooling will run (``$CXX``, else ``c++``)."""
    return os.environ.get("CXX", "c++")


class OpBuilder:
    """Loads one op (see the module docstring); the result is kept for the process."""

    def __init__(
        self, spec: OpSpec, cache_root: Path | None = None, source_root: Path | None = None
    ):
        self.spec = spec
        self._cache_root = cache_root
        self._source_root = source_root
        self._module: ModuleType | None = None
        self._failure: str | None = None  # why load() returned None; set once
        self.build_seconds: float | None = None  # set when this process compiled the op
        self._mutex = threading.Lock()

    # --- paths -------------------------------------------------------------------------------

    @property
    def source_root(self) -> Path | None:
        return self._source_root if self._source_root is not None else csrc_dir()

    @property
    def build_dir(self) -> Path:
        return (self._cache_root if self._cache_root is not None else cache_dir()) / self.spec.name

    def _lock_path(self) -> Path:
        return self.build_dir.parent / f"{self.spec.name}.lock"

    # --- status ------------------------------------------------------------------------------

    def missing_requirement(self) -> str | None:
        """Why a JIT build cannot even start here (no compiler, no ninja, no sources), or None."""
        root = self.source_root
        if root is None:
            return "csrc/ sources not found (install from a source checkout or with ZENGINE_BUILD_OPS=1)"
        missing = [s for s in self.spec.sources if not (root / s).is_file()]
        if missing:
            return f"source files missing: {', '.join(missing)}"
        if shutil.which(_compiler()) is None:
            return f"no C++ compiler found ({_compiler()!r}; set CXX)"
        try:
            from torch.utils.cpp_extension import is_ninja_available
        except ImportError as err:  # a torch without extension tooling
            return f"torch.utils.cpp_extension unavailable: {err}"
        if not is_ninja_available():
            return "ninja is not installed (pip install ninja)"
        return None

    def status(self) -> OpStatus:
        """Where the op stands, without building it."""
        if self._module is not None:
            origin = getattr(self._module, "__file__", "") or ""
            state = (
                OpState.PREBUILT
                if self._module.__name__ == self.spec.prebuilt_module
                else OpState.BUILT
            )
            return OpStatus(state, origin)
        if _disabled_by_env(self.spec.name):
            return OpStatus(OpState.DISABLED, "ZENGINE_DISABLE_OPS")
        if self._failure is not None:
            return OpStatus(OpState.UNAVAILABLE, self._failure)
        if importlib.util.find_spec(self.spec.prebuilt_module) is not None:
            return OpStatus(OpState.PREBUILT, self.spec.prebuilt_module)
        cached = self._cached_library()
        if cached is not None:
            return OpStatus(OpState.BUILT, str(cached))
        reason = self.missing_requirement()
        if reason is not None:
            return OpStatus(OpState.UNAVAILABLE, reason)
        return OpStatus(OpState.BUILDABLE, str(self.build_dir))

    # --- loading -----------------------------------------------------------------------------

    def load(self) -> ModuleType | None:
        """The op's extension module, or None (after one warning) when it cannot be had."""
        if self._module is not None:
            return self._module
        if self._failure is not None:
            return None
        with self._mutex:
            if self._module is None and self._failure is None:
                try:
                    self._module = self._find_or_build()
                except _Unavailable as why:
                    self._failure = str(why)
                    warnings.warn(
                        f"zengine op '{self.spec.name}' is not available ({why}); "
                        "using the torch implementation instead",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        return self._module

    def _find_or_build(self) -> ModuleType:
        if _disabled_by_env(self.spec.name):
            raise _Unavailable("disabled by ZENGINE_DISABLE_OPS")
        prebuilt_error = None
        try:
            return importlib.import_module(self.spec.prebuilt_module)
        except ModuleNotFoundError:
            pass
        except ImportError as err:  # present but broken (e.g. built against another torch)
            prebuilt_error = f"prebuilt {self.spec.prebuilt_module} failed to import: {err}"
        module = self._import_cached()
        if module is not None:
            return module
        reason = self.missing_requirement()
        if reason is not None:
            raise _Unavailable(f"{prebuilt_error}; {reason}" if prebuilt_error else reason)
        return self._build()

    def _build(self) -> ModuleType:
        self.build_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(self._lock_path(), self.spec.name):
            module = self._import_cached()  # another process may have built it while we waited
            if module is not None:
                return module
            # Our lock is held, so no zengine process is inside torch's build of this op; a
            # 'lock' file left there by a killed build would make torch wait forever.
            with contextlib.suppress(FileNotFoundError):
                (self.build_dir / "lock").unlink()
            from torch.utils.cpp_extension import load

            root = self.source_root
            start = time.perf_counter()
            try:
                module = load(
                    name=self.spec.jit_module,
                    sources=[str(root / s) for s in self.spec.sources],
                    extra_cflags=list(self.spec.cflags),
                    extra_ldflags=list(self.spec.ldflags),
                    extra_include_paths=[str(root / d) for d in self.spec.include_dirs],
                    build_directory=str(self.build_dir),
                    verbose=os.environ.get("ZENGINE_OPS_VERBOSE", "") not in ("", "0"),
                )
            except Exception as err:  # compiler errors arrive as RuntimeError with the log
                raise _Unavailable(self._record_failure(err)) from None
            self.build_seconds = time.perf_counter() - start
            log.info("built zengine op %s in %.1f s", self.spec.name, self.build_seconds)
            self._write_stamp(Path(module.__file__))
            return module

    def _record_failure(self, err: Exception) -> str:
        """Keep the full build log in the build folder; return a one-line reason."""
        text = str(err)
        log_path = self.build_dir / "build_error.log"
        with contextlib.suppress(OSError):
            log_path.write_text(text)
        first_error = next(
            (line.strip() for line in text.splitlines() if "error" in line.lower()), ""
        )
        first_error = re.sub(r"\s+", " ", first_error)[:200] or type(err).__name__
        return f"build failed: {first_error} (full log: {log_path})"

    # --- the cache stamp ---------------------------------------------------------------------

    def _fingerprint(self) -> str:
        """Hash of everything the build depends on: sources, headers, flags, torch, Python.

        Not the compiler: a cached build stays usable on a machine where it is gone."""
        import torch

        root = self.source_root
        digest = hashlib.sha256()
        digest.update(
            json.dumps(
                [
                    self.spec.name,
                    self.spec.sources,
                    self.spec.cflags,
                    self.spec.ldflags,
                    self.spec.include_dirs,
                    torch.__version__,
                    sys.implementation.cache_tag,
                ]
            ).encode()
        )
        files = [root / s for s in self.spec.sources]
        for folder in self.spec.include_dirs:
            files += sorted((root / folder).glob("*.h"))
        for path in files:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()

    def _cached_library(self) -> Path | None:
        stamp = self.build_dir / _STAMP
        if self.source_root is None or not stamp.is_file():
            return None
        try:
            recorded = json.loads(stamp.read_text())
            library = Path(recorded["library"])
            if recorded["fingerprint"] == self._fingerprint() and library.is_file():
                return library
        except (OSError, ValueError, KeyError):
            pass
        return None

    def _import_cached(self) -> ModuleType | None:
        library = self._cached_library()
        if library is None:
            return None
        # As torch's loader does: imported from its path, not registered in sys.modules.
        spec = importlib.util.spec_from_file_location(library.name.split(".")[0], library)
        try:  # (a library another source tree's build is rewriting fails here: build ours)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except ImportError as err:
            log.warning(
                "cached build of zengine op %s failed to import (%s); rebuilding",
                self.spec.name,
                err,
            )
            return None
        return module

    def _write_stamp(self, library: Path) -> None:
        stamp = self.build_dir / _STAMP
        tmp = stamp.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"fingerprint": self._fingerprint(), "library": str(library)}))
        os.replace(tmp, stamp)


class _Unavailable(Exception):
    """The op cannot be loaded; the message is the reason shown to the user."""


@contextlib.contextmanager
def _file_lock(path: Path, name: str):
    """An exclusive lock between processes (ranks); released by the OS if a holder dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file is all there is
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to build zengine op %s (lock %s)", name, path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_BUILDERS: dict[str, OpBuilder] = {spec.name: OpBuilder(spec) for spec in ALL_OPS}


def get_builder(name: str) -> OpBuilder:
    """The process-wide builder of a declared op."""
    try:
        return _BUILDERS[name]
    except KeyError:
        raise KeyError(f"unknown zengine op {name!r}; declared: {', '.join(_BUILDERS)}") from None


def load_op(name: str) -> ModuleType | None:
    """The extension module of op ``name``, built on first use; None means: use torch."""
    return get_builder(name).load()


def build_all() -> dict[str, float | None]:
    """Load (building if needed) every declared op, one after another; seconds each, None if
    unavailable."""
    times: dict[str, float | None] = {}
    for name, builder in _BUILDERS.items():
        start = time.perf_counter()
        ready = builder.load() is not None
        times[name] = time.perf_counter() - start if ready else None
    return times
