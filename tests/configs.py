"""One builder of the DeepSpeed-style JSON configs the tests hand to ``zengine.initialize``.

    ds_config(3, "bf16", gas=2, clip=0.5, zero=SMALL_BUCKETS | SHARD_ALL, steps_per_print=1000)

A key the test does not name is left out of the dict (not set to its default), so a test states
exactly what it configures. Sections given as keywords merge into what the builder wrote
(``fp16={...}`` adds to ``{"enabled": True}``); ``DROP`` removes a key. The named presets below are
the settings several tests share.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any, Optional, Union

DROP = object()  # an override value that removes its key
# An offload section: "cpu" / "nvme" (the device alone), a whole section, or None (no offload).
Offload = Union[str, dict, None]

# A few hundred elements: several reduce and all-gather buckets per step of the tests' small models.
SMALL_BUCKETS = {"reduce_bucket_size": 300, "allgather_bucket_size": 200}
# Stage 3: every parameter sharded, none kept whole for being small.
SHARD_ALL = {"stage3_param_persistence_threshold": 0}
# Stage 3 with nothing gathered ahead or kept for reuse: each parameter fetched at its use.
NO_PREFETCH = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}


def adamw(lr: float = 1e-2, **params: Any) -> dict:
    """The ``optimizer`` section of an AdamW at ``lr``, with any further ``params`` (betas, eps)."""
    return {"type": "AdamW", "params": {"lr": lr, **params}}


def sgd(lr: float, **params: Any) -> dict:
    """The ``optimizer`` section of a plain SGD."""
    return {"type": "SGD", "params": {"lr": lr, **params}}


def nvme(path: str, **section: Any) -> dict:
    """An offload section that swaps to files under ``path`` (``buffer_count``... as given)."""
    return {"device": "nvme", "nvme_path": path, **section}


def cpu(**section: Any) -> dict:
    """An offload section that keeps its tensors in host memory (``pin_memory`` as given)."""
    return {"device": "cpu", **section}


def swap_dir(name: str) -> str:
    """A swap folder under the system's temporary directory, shared by the ranks of one test."""
    return os.path.join(tempfile.gettempdir(), name)


def merge(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` merged in place: dicts merge key by key, ``DROP`` removes a key,
    any other value replaces. Returns ``base``."""
    for key, value in overrides.items():
        if value is DROP:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def _offload(section: Offload) -> Optional[dict]:
    return {"device": section} if isinstance(section, str) else section


def ds_config(
    stage: int = 2,
    precision: str = "fp32",
    *,
    micro_batch: Any = 2,
    gas: Any = None,
    optimizer: Optional[dict] = None,
    lr: Optional[float] = 1e-2,
    clip: Any = None,
    zero: Optional[dict] = None,
    offload_optimizer: Offload = None,
    offload_param: Offload = None,
    steps_per_print: Optional[float] = None,
    **sections: Any,
) -> dict:
    """A config for ``zengine.initialize`` (DeepSpeed's JSON schema).

    ``precision``: "fp32" (no section), "bf16" or "fp16" (``{"enabled": True}``, merged with a
    section of that name in ``sections``). ``optimizer``: a whole section (``adamw(...)``,
    ``sgd(...)``); without it an AdamW at ``lr``, and no optimizer section when ``lr`` is None too.
    ``gas``, ``clip`` and ``steps_per_print`` are written only when given. ``zero``: further
    ``zero_optimization`` keys. ``sections``: any other top-level keys, merged last (``merge``)."""
    cfg: dict = {"train_micro_batch_size_per_gpu": micro_batch}
    if gas is not None:
        cfg["gradient_accumulation_steps"] = gas
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    elif lr is not None:
        cfg["optimizer"] = adamw(lr)
    if clip is not None:
        cfg["gradient_clipping"] = clip
    cfg["zero_optimization"] = {"stage": stage, **(zero or {})}
    if offload_optimizer is not None:
        cfg["zero_optimization"]["offload_optimizer"] = _offload(offload_optimizer)
    if offload_param is not None:
        cfg["zero_optimization"]["offload_param"] = _offload(offload_param)
    if steps_per_print is not None:
        cfg["steps_per_print"] = steps_per_print
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return merge(copy.deepcopy(cfg), sections)


# -- presets: the configs of the suites that other tests reuse -------------------------------------
# The parity suite's micro batch, AdamW learning rate and gradient clipping.
PARITY_MICRO, PARITY_LR, PARITY_CLIP = 2, 1e-2, 0.5


def parity_config(
    stage: int,
    precision: str,
    gas: int,
    world: int,
    offload: Any = False,
    zero_extra: Optional[dict] = None,
) -> dict:
    """The parity suite's config (tests/zero/test_zero_parity.py): AdamW, clipping, micro batch 2,
    small buckets; stage 3 shards everything, prefetches a little and keeps few parameters gathered.
    ``offload``: False, True / "cpu" (optimizer on the host), "param" (parameters too), "nvme"
    (moments swapped), "param+nvme", "param-nvme" (parameter shards swapped), "infinity" (both).
    ``world`` is the caller's world size (the config does not depend on it)."""
    zero = {
        **SMALL_BUCKETS,
        **SHARD_ALL,
        "stage3_prefetch_bucket_size": 1500,
        "stage3_max_live_parameters": 4000,
        "stage3_max_reuse_distance": 1000,
    }
    optimizer = param = None
    if offload in ("nvme", "param+nvme", "infinity"):  # moments swapped: 3 buffers, 1000-element
        # chunks
        optimizer = nvme(swap_dir("zswap"), buffer_count=3)
        zero["sub_group_size"] = 1000
    elif offload:  # cpu, param, param-nvme
        optimizer = cpu(pin_memory=True)
    if offload in ("param", "param+nvme"):  # stage 3: parameter shards in host memory too
        param = cpu(pin_memory=True)
    if offload in ("param-nvme", "infinity"):  # stage 3: parameter shards in a swap file, 3 read
        # buffers, the first 50 elements resident (max_in_cpu)
        param = nvme(swap_dir("zswap-params"), buffer_count=3, buffer_size=4096, max_in_cpu=50)
    cfg = ds_config(
        stage,
        precision,
        micro_batch=PARITY_MICRO,
        gas=gas,
        optimizer=adamw(PARITY_LR, betas=[0.9, 0.999], eps=1e-8),
        clip=PARITY_CLIP,
        zero=zero,
        offload_optimizer=optimizer,
        offload_param=param,
        steps_per_print=1000,
    )
    cfg["zero_optimization"].update(zero_extra or {})  # e.g. MiCS's keys (test_zero_mics.py)
    if precision == "fp16":
        cfg["fp16"]["initial_scale_power"] = 8
    return cfg


def stage3_config(**zero: Any) -> dict:
    """Stage 3 sharding every parameter, micro batch 4, AdamW at 1e-2; ``zero``: further keys."""
    return ds_config(3, micro_batch=4, zero={**SHARD_ALL, **zero})
