"""Run an unmodified DeepSpeed script on zengine: ``import deepspeed`` resolves to zengine.

    python -m zengine.compat train.py --deepspeed_config ds.json     # one process
    zengine --deepspeed_compat --num_gpus 2 train.py ...              # every rank

Inside that process only, ``deepspeed`` and the submodules scripts import
(``deepspeed.comm``, ``deepspeed.accelerator``, ``deepspeed.utils``,
``deepspeed.ops.adam``, ``deepspeed.runtime.zero.partition_parameters`` ...)
are zengine's modules of the same meaning (``ALIASES``); the features zengine
does not have (pipeline and tensor parallelism, MoE, inference) fail at import
with a message naming them. Nothing is installed under the name ``deepspeed``,
so libraries that look for the installed distribution by name (transformers,
accelerate, lightning: ``importlib.metadata.version("deepspeed")``) do not
see one: this covers scripts that drive DeepSpeed directly.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from typing import Optional, Sequence

COMPAT_ENV = "ZENGINE_DEEPSPEED_COMPAT"

# deepspeed module -> the zengine module that stands in for it
ALIASES = {
    "deepspeed": "zengine",
    "deepspeed.comm": "zengine.comm",
    "deepspeed.accelerator": "zengine.accelerator",
    "deepspeed.utils": "zengine.utils",
    "deepspeed.utils.zero_to_fp32": "zengine.utils.zero_to_fp32",
    "deepspeed.runtime": "zengine.runtime",
    "deepspeed.runtime.utils": "zengine.runtime.utils",
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
}
# DeepSpeed features outside ZeRO data parallelism: refused at import, by name
REFUSED = {
    "deepspeed.pipe": "pipeline parallelism",
    "deepspeed.runtime.pipe": "pipeline parallelism",
    "deepspeed.moe": "mixture of experts",
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
                raise ImportError(f"{fullname}: {feature} is not part of zengine (ZeRO data parallelism only); "
                                  "this script needs DeepSpeed itself")
        twin = "zengine" + fullname[len("deepspeed"):]
        try:
            module = importlib.import_module(twin)
        except ImportError:
            raise ModuleNotFoundError(f"No module named {fullname!r}: zengine has no counterpart of it "
                                      "(zengine.compat runs scripts that use DeepSpeed's ZeRO surface)",
                                      name=fullname) from None
        return importlib.machinery.ModuleSpec(fullname, _Existing(module))


class _Existing(importlib.abc.Loader):
    """Loads a name as an already imported module."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Make ``import deepspeed`` (and its submodules) resolve to zengine in this process."""
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
