"""How ``checkpoint`` works: DeepSpeed's ``configure``, the config's ``activation_checkpointing``.

What the settings mean here (``configure`` arguments, in brackets the keys of the config's
``activation_checkpointing`` section):

- ``checkpoint_in_cpu`` [``cpu_checkpointing``]: the inputs each checkpointed segment keeps for
  its recomputation are copied to CPU memory (pinned when they come from CUDA) and back to their
  device when backward recomputes. Only these inputs are kept between forward and backward, so
  with every block checkpointed the device holds no activations at all between them.
- ``synchronize`` [``synchronize_checkpoint_boundary``]: wait for the CUDA devices of the
  segment's inputs at the start and end of every checkpointed forward and recomputation (a
  debugging and timing aid; nothing to wait for on the CPU).
- ``profile`` [``profile``]: log the wall time of every checkpointed forward and recomputation
  (synchronising CUDA around each, so the time is the work's, not its launch's).
- ``partition_activations``: DeepSpeed splits each saved input across the ranks of the
  model-parallel group (they hold identical copies) and gathers it for recomputation. zengine has
  no model parallelism: the group is this one rank, and the data-parallel ranks hold activations
  of different samples, which are not copies of each other. Accepted; nothing to partition, as in
  DeepSpeed with a model-parallel size of 1.
- ``contiguous_checkpointing`` [``contiguous_memory_optimization``] and ``num_checkpoints``
  [``number_checkpoints``]: DeepSpeed copies the partitioned inputs into ``num_checkpoints``
  preallocated buffers to avoid fragmentation; it requires ``partition_activations``, and so does
  ``configure`` here. With nothing partitioned the saved inputs are ordinary tensors of torch's
  allocator: accepted, no effect.

Where the settings come from: ``Engine`` applies the config's section at ``initialize``
(``configure_from_config``) unless the script has called ``configure`` itself, whose settings
then stay; a later ``configure`` call replaces them. ``is_configured()`` says whether
``configure`` was called, as in DeepSpeed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

from pydantic import ValidationError

from ..config.activation_checkpointing import ActivationCheckpointingConfig
from ..distributed.process_group import world_rank

logger = logging.getLogger("zengine")


@dataclass(frozen=True)
class CheckpointSettings:
    """The settings ``checkpoint`` reads; field names are the config section's keys."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @classmethod
    def of(cls, section: ActivationCheckpointingConfig) -> "CheckpointSettings":
        """The settings a config section states."""
        return cls(**{f.name: getattr(section, f.name) for f in fields(cls)})


# configure()'s arguments and the section keys they set.
_ARGUMENT_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}

_settings = CheckpointSettings()
_configured = False  # configure() was called (DeepSpeed's is_configured)


def current() -> CheckpointSettings:
    """The settings in force now (what the next ``checkpoint`` call reads)."""
    return _settings


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: Optional[bool] = None,
    contiguous_checkpointing: Optional[bool] = None,
    num_checkpoints: Optional[int] = None,
    checkpoint_in_cpu: Optional[bool] = None,
    synchronize: Optional[bool] = None,
    profile: Optional[bool] = None,
) -> None:
    """Set how ``checkpoint`` works, with DeepSpeed's parameters in DeepSpeed's order.

    Starts from the defaults (all off), then applies the ``activation_checkpointing``
    section of ``deepspeed_config`` (a path to a JSON file, a dict, a config from
    ``zengine.config.load_config``, or an ``ActivationCheckpointingConfig``), then every
    argument that is not None. The module docstring says what each setting does here.

    ``mpu_`` must be None: it is DeepSpeed's model-parallel unit, and zengine has no model
    parallelism. Raises ``ValueError`` for an mpu, for a bad value (naming the argument or
    the config key), and, as DeepSpeed does, for ``contiguous_checkpointing`` without
    ``partition_activations`` or without ``num_checkpoints``.
    """
    global _settings, _configured
    if mpu_ is not None:
        raise ValueError(
            f"zengine.checkpointing.configure: mpu_={type(mpu_).__name__} object "
            f"given, but zengine has no model parallelism (tensor or pipeline), so "
            f"there is no model-parallel unit to use; pass mpu_=None"
        )
    values: Dict[str, Any] = {}
    if deepspeed_config is not None:
        values = _section_of(deepspeed_config).model_dump()
    arguments = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    given = {name: value for name, value in arguments.items() if value is not None}
    for name, value in given.items():
        values[_ARGUMENT_KEYS[name]] = value
    try:
        section = ActivationCheckpointingConfig.model_validate(values)
    except ValidationError as error:
        by_key = {key: name for name, key in _ARGUMENT_KEYS.items() if name in given}
        problems = []
        for item in error.errors():
            key = str(item["loc"][0])
            problems.append(
                f"{by_key.get(key, 'activation_checkpointing.' + key)}: {item['msg']} "
                f"(got {item.get('input')!r})"
            )
        raise ValueError("zengine.checkpointing.configure:\n  " + "\n  ".join(problems)) from None
    if section.contiguous_memory_optimization and not section.partition_activations:
        raise ValueError(
            "zengine.checkpointing.configure: contiguous_checkpointing "
            "(contiguous_memory_optimization) needs partition_activations, "
            "as in DeepSpeed"
        )
    if section.contiguous_memory_optimization and section.number_checkpoints is None:
        raise ValueError(
            "zengine.checkpointing.configure: contiguous_checkpointing "
            "(contiguous_memory_optimization) needs num_checkpoints "
            "(number_checkpoints), as in DeepSpeed"
        )
    _settings = CheckpointSettings.of(section)
    _configured = True
    if world_rank() == 0:
        logger.info("activation checkpointing configured: %s", _describe(_settings))


def configure_from_config(section: ActivationCheckpointingConfig) -> None:
    """Apply the config's ``activation_checkpointing`` section (the engine, at ``initialize``).

    A script that called ``configure`` keeps its settings (in DeepSpeed the engine never
    touches them; there, the section acts only through ``configure(deepspeed_config=...)``).
    Does not change ``is_configured()``.
    """
    global _settings
    if _configured:
        if CheckpointSettings.of(section) != _settings and world_rank() == 0:
            logger.info(
                "activation checkpointing: keeping the settings of "
                "checkpointing.configure() (%s) over the config's "
                "activation_checkpointing section",
                _describe(_settings),
            )
        return
    _settings = CheckpointSettings.of(section)


def is_configured() -> bool:
    """True once ``configure`` has been called (DeepSpeed's meaning; settings from the config
    alone do not count). ``checkpoint`` works either way."""
    return _configured


def reset() -> None:
    """DeepSpeed's reset: free the contiguous checkpoint buffers that a forward without backward
    (evaluation) leaves behind. zengine keeps no such buffers (see ``contiguous_checkpointing``),
    so there is nothing to free; the settings stay, as in DeepSpeed."""


def restore_defaults() -> None:
    """Back to the state of a fresh process: default settings, not configured (for tests)."""
    global _settings, _configured
    _settings, _configured = CheckpointSettings(), False


def _describe(settings: CheckpointSettings) -> str:
    return ", ".join(f"{f.name}={getattr(settings, f.name)}" for f in fields(settings))


def _section_of(config: Any) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a config path, dict or loaded config. Only that
    section is read and checked (DeepSpeed checks the whole file here, batch sizes included, which
    needs the world size; the engine checks the whole file at initialize)."""
    # the loader's reading and wording
    from ..config.load import ConfigError, _describe as describe_errors, _read
    from ..config.models import ZengineConfig

    if isinstance(config, ActivationCheckpointingConfig):
        return config
    if isinstance(config, ZengineConfig):
        return config.activation_checkpointing
    if not isinstance(config, (str, os.PathLike, Mapping)):
        raise ValueError(
            f"zengine.checkpointing.configure: deepspeed_config must be a path to a "
            f"JSON file, a dict or a loaded config, got {type(config).__name__}"
        )
    source, raw = _read(config)
    try:
        section = raw.get("activation_checkpointing")
        loaded = ZengineConfig.model_validate({"activation_checkpointing": section})
    except ValidationError as error:
        raise ConfigError(
            f"invalid activation_checkpointing section in {source}:\n"
            + "\n".join(f"  {line}" for line in describe_errors(error))
        ) from None
    return loaded.activation_checkpointing
