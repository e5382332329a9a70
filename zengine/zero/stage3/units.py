"""What stage 3 gathers together, how long a gathered parameter lives, and how much gradient waits to be
reduced: ``GatherUnits``, read once from ``stage3_gather_units``.

``"module"`` is DeepSpeed's behaviour, key for key: one collective per module, a parameter kept after
its use when the trace uses it again within ``stage3_max_reuse_distance`` elements, gradients reduced in
buckets of ``reduce_bucket_size``.

``"auto"`` (the default) gathers in groups of consecutive modules of up to
``stage3_prefetch_bucket_size`` elements (``trace.py``), about a transformer block at DeepSpeed's
defaults, and gives them FSDP2's lifetimes, which is where stage 3's memory goes at those defaults
(``tests/zero/test_zero3_device_memory.py`` counts it on the stand-in device):

- a parameter is kept after its use only when it is used again within the prefetch window, the
  elements the trace would gather back ahead of use anyway (``stage3_max_reuse_distance`` at most).
  DeepSpeed's default distance, 1e9, holds every parameter of a model below a billion elements from
  its forward use to its backward use: the whole model gathered at the turn of the step, where
  FSDP2 reshards after forward and gathers each block again for backward, keeping only the last;
- gradients are reduced in buckets of at most the prefetch window (``reduce_bucket_size`` at most),
  about a block's, as FSDP2 reduce-scatters each block's gradients when its backward ends. DeepSpeed's
  default bucket, 5e8 elements, holds every gradient of a smaller model in the compute dtype until
  backward ends.

On a 4-block GPT at DeepSpeed's defaults (W = 2, bf16) these two are 4 of the 18.5 bytes a parameter
the device peaks at. With ``stage3_prefetch_bucket_size`` 0 (no prefetch) the user's distance and bucket
stand as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GatherUnits:
    """Stage 3's gather grouping and lifetimes (module docstring)."""

    coalesce: bool  # consecutive units travel as one collective (trace.py's gather groups)
    reuse_distance: int  # elements within which a used parameter is kept gathered
    reduce_bucket: int  # elements of gradient a bucket reduces over all ranks

    @classmethod
    def from_config(cls, zero_cfg: Any) -> "GatherUnits":
        """The units ``zero_cfg`` (a ``ZeroConfig``) asks for."""
        reuse = int(zero_cfg.stage3_max_reuse_distance)
        bucket = int(zero_cfg.reduce_bucket_size)
        window = int(zero_cfg.stage3_prefetch_bucket_size)
        if getattr(zero_cfg, "stage3_gather_units", "auto") != "auto":
            return cls(False, reuse, bucket)
        if window <= 0:
            return cls(True, reuse, bucket)
        return cls(True, min(reuse, window), min(bucket, window))
