"""``deepspeed.runtime.zero.partition_parameters`` as scripts import it: ``Init``,
``GatheredParameters``, ``ZeroParamStatus``."""
from .init import GatheredParameters, Init
from .stage3.param import ZeroParameter, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParameter"]
