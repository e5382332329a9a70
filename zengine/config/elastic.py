"""The ``elasticity`` section and its rule: one global batch size that trains unchanged at many world sizes.

A job that may restart with fewer or more ranks (``zengine --max_restarts``, a
preempted node) keeps its optimization meaning only if the global batch size
stays the same. The ``elasticity`` config section lists the micro batch sizes
that fit in a rank's memory and an upper bound on the global batch; this module
picks the global batch size ``B`` that the most world sizes can reach as
``micro batch * world size * accumulation steps``, and, at the world size a run
actually has, the micro batch and accumulation steps that reach it.

``load_config`` applies the rule when a config enables the section (``batch.py``),
so ``zengine.initialize`` trains with the elastic batch sizes at its world size.
``zengine.elasticity`` is DeepSpeed's public name for it: ``compute_elastic_config``
reads a whole config dict and hands the validated section to ``elastic_config``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from pydantic import Field, model_validator

from .base import Count, Flag, Integer, Number, _Section

LATEST_VERSION = 0.2
"""The newest elasticity ``version`` implemented. From 0.2 on, only world sizes that are a multiple of
``num_gpus_per_node`` count (whole nodes join and leave)."""


class ElasticityError(ValueError):
    """An elastic batch size cannot be chosen or used (DeepSpeed's exception name)."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size of this run is not one the elastic batch size can be split over."""


class ElasticityConfig(_Section):
    """Elastic training (DeepSpeed's section): one global batch size that many world sizes can train with,
    the micro batch and accumulation steps derived at the world size a run (or a restart) has. When enabled
    it chooses all three batch keys; ``zengine.elasticity`` holds the rule."""

    LATEST_VERSION: ClassVar[float] = LATEST_VERSION

    enabled: Flag = Field(
        False,
        description="Choose the batch sizes elastically; train_batch_size, "
        "train_micro_batch_size_per_gpu and gradient_accumulation_steps "
        "are then not given (see ignore_non_elastic_batch_info).",
    )
    max_train_batch_size: Optional[Count] = Field(
        None, description="Largest acceptable global batch size; required when enabled."
    )
    micro_batch_sizes: Optional[List[Count]] = Field(
        None,
        description="Micro batch sizes per rank that fit "
        "in memory; required when enabled. At a "
        "world size the largest usable one is "
        "chosen.",
    )
    min_gpus: Count = Field(
        1, description="Smallest data-parallel world size the batch size should suit."
    )
    max_gpus: Count = Field(
        10000, description="Largest data-parallel world size the batch size should suit."
    )
    min_time: Integer = Field(
        0,
        ge=0,
        description="Minimum minutes a run should last before it may be "
        "rescaled, for a scheduler; accepted, no effect in zengine.",
    )
    version: Number = Field(
        LATEST_VERSION,
        gt=0,
        description=(
            "Rule version: 0.1 counts every world size in range, 0.2 only multiples of num_gpus_per_node."
        ),
    )
    ignore_non_elastic_batch_info: Flag = Field(
        False,
        description="Ignore (with a warning) batch keys given "
        "alongside enabled elasticity instead of "
        "refusing the config.",
    )
    prefer_larger_batch: Flag = Field(
        True,
        description="Between batch sizes usable at equally many world "
        "sizes, take the larger (false: the smaller).",
    )
    num_gpus_per_node: Count = Field(
        1,
        description="Ranks per node; from version 0.2 only world sizes that are whole nodes count.",
    )
    model_parallel_size: Count = Field(
        1,
        description="Ranks per model replica; zengine has no model "
        "parallelism, so only 1 is accepted.",
    )

    @model_validator(mode="after")
    def _usable_when_enabled(self) -> "ElasticityConfig":
        """The checks across keys; a disabled section is inert (as in DeepSpeed), so only its types are
        checked."""
        if not self.enabled:
            return self
        problems = []
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if getattr(self, key) is None:
                problems.append(f"{key}: required when elasticity is enabled")
        if self.micro_batch_sizes is not None and not self.micro_batch_sizes:
            problems.append("micro_batch_sizes: list at least one micro batch size")
        if self.max_train_batch_size is not None and self.micro_batch_sizes:
            too_large = sorted({m for m in self.micro_batch_sizes if m > self.max_train_batch_size})
            if too_large:
                problems.append(
                    f"micro_batch_sizes: {too_large} exceed max_train_batch_size "
                    f"{self.max_train_batch_size}, so they could never be used"
                )
        if self.max_gpus < self.min_gpus:
            problems.append(f"max_gpus: {self.max_gpus} is less than min_gpus {self.min_gpus}")
        if self.version > self.LATEST_VERSION:
            problems.append(
                f"version: zengine implements elasticity versions up to {self.LATEST_VERSION}, "
                f"got {self.version}"
            )
        if self.model_parallel_size != 1:
            problems.append(
                f"model_parallel_size: zengine has no model parallelism (data parallel only), "
                f"so it must be 1; got {self.model_parallel_size}"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self


def elasticity_enabled(ds_config: Dict[str, Any]) -> bool:
    """True when ``ds_config`` has an ``elasticity`` section saying ``"enabled": true``."""
    section = ds_config.get("elasticity") if isinstance(ds_config, dict) else None
    return isinstance(section, dict) and section.get("enabled") is True


def elastic_batch_size(
    max_train_batch_size: int,
    micro_batch_sizes: Sequence[int],
    min_gpus: int = 1,
    max_gpus: int = 10000,
    num_gpus_per_node: int = 1,
    prefer_larger_batch: bool = True,
    version: float = LATEST_VERSION,
) -> Tuple[int, List[int]]:
    """The global batch size usable at the most world sizes, and those world sizes (sorted).

    ``B`` is usable at world size ``g`` when ``B = m * g * k`` for a micro batch ``m`` in
    ``micro_batch_sizes`` and a whole number of accumulation steps ``k >= 1``. Every ``B`` from 1 to
    ``max_train_batch_size`` is a candidate; the world sizes counted are ``g`` in
    ``[min_gpus, max_gpus]``, and from version 0.2 on only the multiples of ``num_gpus_per_node``.
    Among equally usable sizes the larger wins when ``prefer_larger_batch``, else the smaller.
    Raises ``ElasticityError`` when no candidate is usable at any counted world size.
    """
    micro = _micro_set(micro_batch_sizes)
    step = num_gpus_per_node if version >= 0.2 else 1
    _check_positive(
        max_train_batch_size=max_train_batch_size,
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        num_gpus_per_node=num_gpus_per_node,
    )
    return _search(max_train_batch_size, micro, min_gpus, max_gpus, step, bool(prefer_larger_batch))


def elastic_micro_batch(
    batch_size: int,
    micro_batch_sizes: Sequence[int],
    world_size: int,
    valid_world_sizes: Optional[Sequence[int]] = None,
) -> Tuple[int, int]:
    """``(micro batch, gradient accumulation steps)`` that split ``batch_size`` over ``world_size`` ranks.

    The micro batch is the largest of ``micro_batch_sizes`` that divides ``batch_size / world_size``
    (the largest that fits is the fastest, with the fewest accumulation steps). ``valid_world_sizes``,
    when given, is the list ``elastic_batch_size`` returned: a world size outside it is refused even
    when the arithmetic would work (it is outside ``[min_gpus, max_gpus]`` or not whole nodes). Raises
    ``ElasticityIncompatibleWorldSize`` naming the valid world sizes.
    """
    _check_positive(batch_size=batch_size, world_size=world_size)
    micro_set = _micro_set(micro_batch_sizes)
    if valid_world_sizes is None or world_size in valid_world_sizes:
        for micro in reversed(micro_set):
            if batch_size % (micro * world_size) == 0:
                return micro, batch_size // (micro * world_size)
    if valid_world_sizes is None:
        valid_world_sizes = _usable_world_sizes(batch_size, micro_set, 1, batch_size, 1)
    raise ElasticityIncompatibleWorldSize(
        _incompatible_message(batch_size, world_size, valid_world_sizes)
    )


def elastic_config(
    section: ElasticityConfig, world_size: int = 0, return_microbatch: bool = False
) -> Union[Tuple[int, List[int]], Tuple[int, List[int], int]]:
    """``compute_elastic_config`` on a validated section: ``(final_batch_size, valid_gpus)``, and with
    ``world_size > 0`` (or ``return_microbatch``) also the micro batch per rank at that world size.

    ``return_microbatch`` without a ``world_size`` reads the world size from the ``WORLD_SIZE``
    environment variable, as a launched rank has it. Raises ``ElasticityConfigError`` for a disabled
    section and ``ElasticityIncompatibleWorldSize`` when the world size cannot use the chosen batch size.
    """
    if not section.enabled:
        raise ElasticityConfigError(
            'compute_elastic_config: elasticity is not enabled (set "enabled": true)'
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0:
        raise ValueError(
            f"compute_elastic_config: world_size must be an int >= 0, got {world_size!r}"
        )
    batch, valid = elastic_batch_size(
        section.max_train_batch_size,
        section.micro_batch_sizes,
        section.min_gpus,
        section.max_gpus,
        section.num_gpus_per_node,
        section.prefer_larger_batch,
        section.version,
    )
    if world_size == 0 and not return_microbatch:
        return batch, valid
    if world_size == 0:
        world_size = _world_size_from_environment()
    micro, _ = elastic_micro_batch(batch, section.micro_batch_sizes, world_size, valid)
    return batch, valid, micro


# --- the search ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _search(
    limit: int, micro: Tuple[int, ...], min_gpus: int, max_gpus: int, step: int, prefer_larger: bool
) -> Tuple[int, List[int]]:
    """``elastic_batch_size`` on normalized arguments; cached because a config is loaded more than once
    (the estimator, then ``initialize``) and a large search takes a noticeable fraction of a second."""
    first = max(
        step, -(-min_gpus // step) * step
    )  # the smallest multiple of step that is >= min_gpus
    # A world size larger than limit / smallest micro batch cannot reach any batch size <= limit.
    last = min(max_gpus, limit // micro[0])
    if first > last:
        raise ElasticityError(_nothing_usable(limit, micro, min_gpus, max_gpus, step))
    # Only the micro batches that no other one divides matter for *whether* B is usable at g: m * g | B
    # implies d * g | B for every divisor d of m that is itself a micro batch.
    minimal = [m for m in micro if not any(m % d == 0 for d in micro if d < m)]
    counts = [0] * (limit + 1)
    seen_at = [0] * (limit + 1)  # the last g that counted B, so that two micro batches count g once
    # Sieve from the world-size side: for each g, mark the multiples of m * g. Enumerating divisors per
    # candidate B would cost about the same in theory but much more in Python's per-call overhead.
    for g in range(first, last + 1, step):
        for m in minimal:
            stride = m * g
            if stride > limit:
                break
            for b in range(stride, limit + 1, stride):
                if seen_at[b] != g:
                    seen_at[b] = g
                    counts[b] += 1
    best = max(counts)
    if best == 0:
        raise ElasticityError(_nothing_usable(limit, micro, min_gpus, max_gpus, step))
    batch = (limit - counts[::-1].index(best)) if prefer_larger else counts.index(best)
    return batch, _usable_world_sizes(batch, micro, min_gpus, max_gpus, step)


def _usable_world_sizes(
    batch: int, micro: Iterable[int], min_gpus: int, max_gpus: int, step: int
) -> List[int]:
    """The world sizes ``g`` in range (multiples of ``step``) with ``batch = m * g * k``: the divisors of
    ``batch / m`` for each micro batch ``m`` that divides ``batch``."""
    found = set()
    for m in micro:
        if batch % m:
            continue
        quotient = batch // m
        for d in range(1, math.isqrt(quotient) + 1):
            if quotient % d == 0:
                found.update((d, quotient // d))
    return sorted(g for g in found if min_gpus <= g <= max_gpus and g % step == 0)


def _micro_set(micro_batch_sizes: Sequence[int]) -> Tuple[int, ...]:
    """The distinct micro batch sizes, ascending; refuses an empty list or a size below 1."""
    if isinstance(micro_batch_sizes, (int, str)) or not micro_batch_sizes:
        raise ElasticityConfigError(
            f"micro_batch_sizes must be a non-empty list of positive ints, "
            f"got {micro_batch_sizes!r}"
        )
    for m in micro_batch_sizes:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ElasticityConfigError(f"micro_batch_sizes must hold positive ints, got {m!r}")
    return tuple(sorted(set(micro_batch_sizes)))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ElasticityConfigError(f"{name} must be a positive int, got {value!r}")


def _world_size_from_environment() -> int:
    text = os.environ.get("WORLD_SIZE", "")
    if not text.isdigit() or int(text) < 1:
        raise ElasticityConfigError(
            "compute_elastic_config: return_microbatch needs the world size: pass "
            f"world_size=, or run where WORLD_SIZE is set (it is {text!r})"
        )
    return int(text)


# --- messages --------------------------------------------------------------------------------------------


def abbreviate(sizes: Sequence[int], head: int = 10, tail: int = 3) -> str:
    """``"1, 2, 3"``, or for a long list its first and last few: ``"1, 2, ..., 9990, 9995 (417 in all)"``."""
    if len(sizes) <= head + tail + 1:
        return ", ".join(map(str, sizes))
    return (
        ", ".join(map(str, sizes[:head]))
        + ", ..., "
        + ", ".join(map(str, sizes[-tail:]))
        + f" ({len(sizes)} in all)"
    )


def _incompatible_message(batch: int, world_size: int, valid: Sequence[int]) -> str:
    below = [g for g in valid if g < world_size]
    above = [g for g in valid if g > world_size]
    nearest = ", ".join(str(g) for g in (below[-1:] + above[:1]))
    near = f" (the nearest: {nearest})" if nearest else ""
    return (
        f"world size {world_size} cannot use the elastic global batch size {batch}: it is not one of the "
        f"valid world sizes {abbreviate(valid) or '(none)'}; start the job on one of them{near}, or change "
        "elasticity's micro_batch_sizes, max_train_batch_size, min_gpus or max_gpus"
    )


def _nothing_usable(
    limit: int, micro: Sequence[int], min_gpus: int, max_gpus: int, step: int
) -> str:
    nodes = f", multiples of num_gpus_per_node {step}" if step > 1 else ""
    return (
        f"no batch size up to max_train_batch_size {limit} is a micro batch in {list(micro)} times a world "
        f"size in [{min_gpus}, {max_gpus}]{nodes}; raise max_train_batch_size or widen the world sizes"
    )
