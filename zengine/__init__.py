"""zengine: ZeRO data-parallel training for PyTorch, a drop-in for DeepSpeed's ZeRO.

    engine, optimizer, dataloader, scheduler = zengine.initialize(model=model, config="configs/zero2.json")

DeepSpeed's other public modules are here under the same names, imported on first use:
``zengine.comm``, ``zengine.accelerator``, ``zengine.utils``, ``zengine.runtime``,
``zengine.checkpointing`` (activation checkpointing), ``zengine.ops``, ``zengine.checkpoint``,
``zengine.elasticity`` (``compute_elastic_config``).
See README.md, docs/API.md (the public surface) and docs/architecture.md.
"""

import importlib

from .api import initialize
from .distributed import init_distributed
from .distributed.agreement import CollectiveCallError
from .distributed.diagnose import CollectiveTimeoutError, RanksOutOfStepError
from .distributed.identity import CollectiveMismatchError
from .engine import DeepSpeedEngine, Engine
from .engine.build import UnfrozenParameterError
from .engine.module_guard import EngineModuleError
from . import zero
from .launcher.args import add_config_arguments
from .zero.nonfinite import NonFiniteGradientError
from .zero.param_writes import ParameterWriteError
from .zero.user_clipping import ShardedGradientError
from .zero.stage3.fetcher import FetchOrderError
from .zero.stage3.grads import ExternalUseError

__version__ = "0.1.0"
__all__ = [
    "initialize",
    "init_distributed",
    "Engine",
    "DeepSpeedEngine",
    "add_config_arguments",
    "zero",
    "__version__",
    # what a training step may raise (docs/API.md, "Errors and environment")
    "CollectiveCallError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "EngineModuleError",
    "ExternalUseError",
    "FetchOrderError",
    "NonFiniteGradientError",
    "ParameterWriteError",
    "ShardedGradientError",
    "RanksOutOfStepError",
    "UnfrozenParameterError",
]

# Submodules a DeepSpeed script reaches as attributes (deepspeed.comm.get_rank(), deepspeed.ops.adam ...)
# without importing them first; imported when first touched, so that `import zengine` stays light.
_LAZY = (
    "accelerator",
    "checkpoint",
    "checkpointing",
    "comm",
    "elasticity",
    "monitor",
    "ops",
    "runtime",
    "utils",
)


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'zengine' has no attribute {name!r}")
