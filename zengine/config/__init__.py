"""zengine's config: DeepSpeed's JSON keys as validated pydantic models.

    cfg = load_config("configs/zero2.json", world_size=4)   # raises ConfigError listing every problem
    print(format_config(cfg))                               # key.path = value, * where changed

``models`` holds ``ZengineConfig``, the whole config, made of the typed sections
in ``precision``, ``zero``, ``optimizer`` (its params checked with
``zengine.optim``'s rules), ``monitor``, ``activation_checkpointing`` and
``elastic``, on the value types of ``base``. ``unsupported`` lists the DeepSpeed
keys zengine knows but does not implement, ``batch`` the batch-size rule (and
the elastic one, whose search is in ``elastic``; ``zengine.elasticity`` is its
DeepSpeed name), ``load`` reading (JSON, or hjson's comments and trailing
commas as DeepSpeed accepts them) and error messages, ``report`` the log
rendering.
"""

from .batch import BatchSizes, resolve_batch_sizes, resolve_elastic_batch_sizes
from .elastic import ElasticityConfig
from .load import ConfigError, ConfigWarning, load_config, load_zero_sections
from .models import ZengineConfig
from .optimizer import SUPPORTED_OPTIMIZERS, SUPPORTED_SCHEDULERS, OptimizerConfig, SchedulerConfig
from .precision import BF16Config, FP16Config
from .report import format_config
from .unsupported import UNSUPPORTED_KEYS
from .zero import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "ConfigError",
    "ConfigWarning",
    "ElasticityConfig",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
    "SchedulerConfig",
    "UNSUPPORTED_KEYS",
    "ZengineConfig",
    "ZeroConfig",
    "format_config",
    "load_config",
    "load_zero_sections",
    "resolve_batch_sizes",
    "resolve_elastic_batch_sizes",
]
