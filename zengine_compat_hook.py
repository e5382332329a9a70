"""Compatibility mode for every process: run by ``zengine-deepspeed-compat.pth`` at interpreter start.

pip puts that one-line ``.pth`` file in site-packages with zengine. It imports this module only when
``ZENGINE_DEEPSPEED_COMPAT`` is set (1, true, yes or on), and ``arm()`` then adds a finder that stays
idle until the process first asks for DeepSpeed (``import deepspeed``, ``find_spec("deepspeed")``,
``importlib.metadata.version("deepspeed")``); only then is zengine imported and ``zengine.compat.install``
run. A process that never asks pays for nothing but this file. So processes that other tools start
themselves (``accelerate launch`` and its ranks, the ranks Lightning spawns, ``torchrun``) get the
compatibility mode from the one environment variable.

Standard library only, and outside the ``zengine`` package: importing ``zengine`` imports torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ENV = "ZENGINE_DEEPSPEED_COMPAT"
ON = ("1", "true", "yes", "on")


def wanted(environ=os.environ) -> bool:
    """Whether the environment asks for the compatibility mode."""
    return environ.get(ENV, "").strip().lower() in ON


class _FirstAsk(importlib.abc.MetaPathFinder):
    """Idle until DeepSpeed is asked for; then installs zengine's compatibility mode and steps aside."""

    def _install(self) -> bool:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        import zengine.compat

        zengine.compat.install()
        return True

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "deepspeed" or fullname.startswith("deepspeed."):
            self._install()
            return importlib.util.find_spec(fullname)
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("_", "-") == "deepspeed":
            self._install()
            import importlib.metadata

            yield from importlib.metadata.distributions(name="deepspeed")


def arm() -> None:
    """Add the idle finder, unless a real DeepSpeed is importable: the compatibility mode never hides
    it (one line on stderr says so, and the process goes on with DeepSpeed itself)."""
    if not wanted() or any(isinstance(f, _FirstAsk) for f in sys.meta_path):
        return
    real = importlib.machinery.PathFinder.find_spec("deepspeed")
    if real is not None and real.origin not in (None, "namespace"):
        sys.stderr.write(
            f"zengine: {ENV} is set but a real DeepSpeed is installed ({real.origin}); "
            "not standing in for it (pip uninstall deepspeed to run on zengine)\n"
        )
        return
    sys.meta_path.insert(0, _FirstAsk())
