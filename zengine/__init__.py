"""zengine: ZeRO data-parallel training for PyTorch, a drop-in for DeepSpeed's ZeRO.

    engine, optimizer, dataloader, scheduler = zengine.initialize(model=model, config="configs/zero2.json")

See README.md and shared/API.md.
"""
from .api import initialize
from .distributed import init_distributed
from .engine import Engine
from . import zero
from .launcher.args import add_config_arguments

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "Engine", "add_config_arguments", "zero", "__version__"]
