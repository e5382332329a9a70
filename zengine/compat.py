"""Run an unmodified DeepSpeed script on zengine: ``import deepspeed`` resolves to zengine.

    python -m zengine.compat train.py --deepspeed_config ds.json     # one process
    zengine --deepspeed_compat --num_gpus 2 train.py ...              # every rank

Inside that process only, ``deepspeed`` and the submodules scripts import
(``deepspeed.comm``, ``deepspeed.accelerator``, ``deepspeed.utils``,
``deepspeed.ops.adam``, ``deepspeed.runtime.zero.partition_parameters`` ...)
are zengine's modules of the same meaning (``ALIASES``); the features zengine
does not have (pipeline and tensor parallelism, inference) fail at import; MoE layers fail when built
with a message naming them.

Libraries that decide from the installed *distribution* (transformers and
accelerate ask ``importlib.util.find_spec("deepspeed")`` and then
``importlib.metadata.metadata`` / ``version("deepspeed")``) get their answers
from the same finder: inside the process, a ``deepspeed`` distribution of
version ``DEEPSPEED_VERSION`` (the DeepSpeed release whose surface zengine
follows) is visible. Nothing is written to site-packages, so other processes
see nothing. A real DeepSpeed importable beside zengine is never shadowed:
``install()`` refuses, naming where it is.

Launchers that start the processes themselves take the module as their target:
``torchrun --nproc_per_node 2 -m zengine.compat train.py ...``,
``accelerate launch -m zengine.compat train.py ...``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import runpy
import sys
from typing import Optional, Sequence

# The DeepSpeed release whose public surface (initialize, config keys, engine members) zengine follows;
# the version the compatibility mode reports for the ``deepspeed`` distribution.
DEEPSPEED_VERSION = "0.19.8"

# deepspeed module -> the zengine module that stands in for it
ALIASES = {
    "deepspeed": "zengine",
    "deepspeed.comm": "zengine.comm",
    "deepspeed.accelerator": "zengine.accelerator",
    "deepspeed.utils": "zengine.utils",
    "deepspeed.utils.zero_to_fp32": "zengine.utils.zero_to_fp32",
    "deepspeed.utils.logging": "zengine.utils.logging",
    "deepspeed.runtime": "zengine.runtime",
    "deepspeed.runtime.utils": "zengine.runtime.utils",
    "deepspeed.runtime.base_optimizer": "zengine.runtime.base_optimizer",
    "deepspeed.runtime.dataloader": "zengine.runtime.dataloader",
    "deepspeed.runtime.engine": "zengine.engine",
    "deepspeed.runtime.zero": "zengine.zero",
    "deepspeed.runtime.zero.partition_parameters": "zengine.zero.partition_parameters",
    "deepspeed.runtime.zero.offload_config": "zengine.engine.members",  # OffloadDeviceEnum, OffloadStateTypeEnum
    "deepspeed.zero": "zengine.zero",
    "deepspeed.ops": "zengine.ops",
    "deepspeed.ops.adam": "zengine.ops.adam",
    "deepspeed.checkpointing": "zengine.checkpointing",
    "deepspeed.runtime.activation_checkpointing": "zengine.checkpointing",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "zengine.checkpointing",
    "deepspeed.monitor": "zengine.monitor",
    "deepspeed.elasticity": "zengine.elasticity",
    "deepspeed.launcher": "zengine.launcher",
    "deepspeed.runtime.lr_schedules": "zengine.runtime.lr_schedules",
    "deepspeed.checkpoint": "zengine.checkpoint",
    "deepspeed.checkpoint.utils": "zengine.checkpoint.utils",
    "deepspeed.checkpoint.constants": "zengine.checkpoint.constants",
    # the classes DeepSpeed's checkpoint files pickle (its zero_to_fp32.py unpickles them)
    "deepspeed.runtime.fp16": "zengine.runtime.pickled",
    "deepspeed.runtime.fp16.loss_scaler": "zengine.runtime.pickled",
    "deepspeed.runtime.zero.config": "zengine.runtime.pickled",
    "deepspeed.utils.tensor_fragment": "zengine.runtime.pickled",
    "deepspeed.moe": "zengine.moe",  # the import surface; building an MoE layer is refused (zengine/moe)
    "deepspeed.moe.utils": "zengine.moe.utils",
    "deepspeed.moe.layer": "zengine.moe.layer",
}
# DeepSpeed features outside ZeRO data parallelism: refused at import, by name
REFUSED = {
    "deepspeed.pipe": "pipeline parallelism",
    "deepspeed.runtime.pipe": "pipeline parallelism",
    "deepspeed.inference": "the inference engine",
    "deepspeed.module_inject": "kernel injection / tensor parallelism",
    "deepspeed.sequence": "sequence parallelism",
}


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Answers for ``deepspeed.*`` names not aliased up front: a refusal, or zengine's module of the same
    dotted name when there is one, else a ModuleNotFoundError that says what zengine lacks."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        for name, feature in REFUSED.items():
            if fullname == name or fullname.startswith(name + "."):
                raise ImportError(
                    f"{fullname}: {feature} is not part of zengine (ZeRO data parallelism only); "
                    "this script needs DeepSpeed itself"
                )
        twin = "zengine" + fullname[len("deepspeed") :]
        try:
            module = importlib.import_module(twin)
        except ImportError:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: zengine has no counterpart of it "
                "(zengine.compat runs scripts that use DeepSpeed's ZeRO surface)",
                name=fullname,
            ) from None
        return importlib.machinery.ModuleSpec(fullname, _Existing(module))

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """``importlib.metadata``'s question: the stand-in ``deepspeed`` distribution, when asked for it
        (or for every distribution)."""
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("_", "-") == "deepspeed":
            yield StandInDistribution()


class StandInDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution as ``importlib.metadata`` reports it under the compatibility mode:
    name, version ``DEEPSPEED_VERSION``, and a summary that says zengine stands in for it. It lists no
    files (nothing is installed)."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename in ("METADATA", "PKG-INFO"):
            return (
                f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {DEEPSPEED_VERSION}\n"
                f"Summary: zengine standing in for DeepSpeed {DEEPSPEED_VERSION} (zengine.compat)\n"
                "Author: zengine\nLicense: Apache-2.0\n"
            )
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path):
        import pathlib

        return pathlib.Path(os.path.dirname(os.path.abspath(__file__))) / str(path)


class RealDeepSpeedError(RuntimeError):
    """zengine.compat was asked to stand in for DeepSpeed where a real DeepSpeed is importable."""


def real_deepspeed() -> Optional[str]:
    """Where a real DeepSpeed would be imported from (a path), or None. Looks on ``sys.path`` with the
    standard finder only (a folder named ``deepspeed`` without ``__init__.py`` is no package), and at a
    ``deepspeed`` module already imported that is not zengine."""
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and getattr(loaded, "__name__", None) != "zengine":
        return getattr(loaded, "__file__", None) or repr(loaded)
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    if spec is None or spec.origin in (
        None,
        "namespace",
    ):  # none, or a plain folder named deepspeed (configs)
        return None
    return spec.origin


class _Existing(importlib.abc.Loader):
    """Loads a name as an already imported module."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Make ``import deepspeed`` (and its submodules) resolve to zengine in this process, and let
    ``importlib.util.find_spec`` / ``importlib.metadata`` see a ``deepspeed`` distribution
    (``DEEPSPEED_VERSION``). Raises ``RealDeepSpeedError`` when a real DeepSpeed is importable: the
    compatibility mode never hides it (uninstall it, or run without the compatibility mode)."""
    if not any(isinstance(f, _DeepSpeedFinder) for f in sys.meta_path):
        where = real_deepspeed()
        if where is not None:
            raise RealDeepSpeedError(
                f"zengine.compat: a real DeepSpeed is importable ({where}); the compatibility mode would shadow "
                "it. Use DeepSpeed itself, or uninstall it (pip uninstall deepspeed) to run this script on zengine"
            )
    for name, target in ALIASES.items():
        if name not in sys.modules:
            try:
                sys.modules[name] = importlib.import_module(target)
            except ImportError:
                continue  # left to the finder, which explains what is missing when a script imports it
    if not any(isinstance(f, _DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedFinder())


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m zengine.compat SCRIPT [ARGS...]``: run SCRIPT as ``__main__`` with the aliases in place."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m zengine.compat SCRIPT [ARGS...]")
    install()
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
