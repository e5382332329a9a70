"""DeepSpeed's mixture-of-experts import surface, so scripts that import it run on zengine.

zengine has no expert parallelism. Scripts import ``deepspeed.moe`` even when their MoE switch is off
(DeepSpeed's CIFAR-10 example imports ``split_params_into_different_moe_groups_for_optimizer`` at the
top): the helpers that only sort parameters work (no parameter is an expert's here), and building an
MoE layer fails by name with the way out.
"""

from .layer import MoE
from .utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["MoE", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
