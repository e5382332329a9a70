"""Compiled CPU kernels and their Python front ends.

- ``CPUAdam`` (alias ``DeepSpeedCPUAdam``) and ``adam_step_``: SIMD Adam/AdamW over fp32
  shards, optionally writing bf16/fp16 copies of the updated parameters in the same pass; over
  bf16 master shards with bf16 or fp32 moments (``adam_step_bf16_``, rounded as ``Rounding``
  says: nearest, Kahan-compensated or stochastic), and over fp16 master shards with fp32 moments
  (fp16_master_weights_and_grads, nearest).
- ``flatten`` / ``unflatten_into``: threaded copies between tensor lists and flat buffers.
- ``unscale_and_norm_``: gradient unscale + sum of squares + non-finite check in one pass.
- ``quantize_blocks`` / ``dequantize_blocks`` / ``dequantize_sum``: ZeRO++'s blockwise int8/int4 codec.

The kernels live in ``csrc/`` and are declared in ``ops.py``; ``builder.py`` builds them on
first use (or uses the ones ``ZENGINE_BUILD_OPS=1`` installed) and falls back to torch, with
one warning, where they cannot be built. Importing this package builds nothing.
``zengine-report`` shows what is built.
"""

from .adam_bf16 import Rounding, adam_step_bf16_
from .adam import CPUAdam, DeepSpeedCPUAdam, FusedAdam, adam_step_, simd_path, simd_paths
from .builder import build_all, get_builder, load_op
from .flatten import flatten, unflatten_into
from .grad import GradStats, unscale_and_norm_
from .ops import ALL_OPS
from .quantize import dequantize_blocks, dequantize_sum, quantize_blocks

__all__ = [
    "CPUAdam",
    "DeepSpeedCPUAdam",
    "FusedAdam",
    "adam_step_",
    "adam_step_bf16_",
    "Rounding",
    "simd_path",
    "simd_paths",
    "flatten",
    "unflatten_into",
    "GradStats",
    "unscale_and_norm_",
    "quantize_blocks",
    "dequantize_blocks",
    "dequantize_sum",
    "load_op",
    "get_builder",
    "build_all",
    "ALL_OPS",
]
