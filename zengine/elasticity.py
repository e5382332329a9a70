"""Elastic batch sizes under DeepSpeed's name (``deepspeed.elasticity``).

One global batch size that trains unchanged at many world sizes, so that a job
restarted with fewer or more ranks keeps its optimization meaning:

    batch, world_sizes = compute_elastic_config(ds_config)                     # DeepSpeed's signature
    batch, world_sizes, micro = compute_elastic_config(ds_config, world_size=8)

The section's model and the rule itself are in ``zengine.config.elastic``, where
``load_config`` uses them; this module reads a whole config dict for
``compute_elastic_config`` and re-exports the rest.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple, Union

from .config.elastic import (
    LATEST_VERSION,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    abbreviate,
    elastic_batch_size,
    elastic_config,
    elastic_micro_batch,
    elasticity_enabled,
)
from .config.load import ConfigError, load_section

__all__ = [
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "LATEST_VERSION",
    "abbreviate",
    "compute_elastic_config",
    "elastic_batch_size",
    "elastic_micro_batch",
    "elasticity_enabled",
]


def compute_elastic_config(
    ds_config: Dict[str, Any],
    target_deepspeed_version: str = "",
    world_size: int = 0,
    return_microbatch: bool = False,
) -> Union[Tuple[int, List[int]], Tuple[int, List[int], int]]:
    """The elastic batch size of a DeepSpeed config dict, as DeepSpeed's function of this name returns it.

    Returns ``(final_batch_size, valid_gpus)``; with ``world_size > 0`` (or ``return_microbatch``)
    also the micro batch per rank at that world size: ``(final_batch_size, valid_gpus, micro_batch_size)``.
    ``return_microbatch`` without a ``world_size`` reads the world size from the ``WORLD_SIZE``
    environment variable, as a launched rank has it. ``target_deepspeed_version`` is accepted for
    DeepSpeed's signature; zengine has one implementation, selected by the section's ``version``.
    Raises ``ElasticityConfigError`` for a missing, disabled or invalid section and
    ``ElasticityIncompatibleWorldSize`` when the world size cannot use the chosen batch size.
    """
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError(
            f"compute_elastic_config: ds_config must be a dict, got {type(ds_config).__name__}"
        )
    if "elasticity" not in ds_config:
        raise ElasticityConfigError(
            'compute_elastic_config: the config has no "elasticity" section'
        )
    try:
        # load_section rather than the model alone: its messages name the keys from the top level.
        section = load_section("elasticity", ds_config["elasticity"])
    except ConfigError as error:
        raise ElasticityConfigError(str(error)) from None
    return elastic_config(section, world_size, return_microbatch)
