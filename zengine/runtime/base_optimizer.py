"""DeepSpeed's ``deepspeed.runtime.base_optimizer``: the classes its ZeRO optimizers derive from
(Fabric's ``load`` restores optimizer state only into a ``DeepSpeedOptimizer``). The classes are
``zengine/zero/base_optimizer.py``'s; this face only names them where DeepSpeed does."""

from ..zero.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
