"""The batch-size rule: train_batch_size = micro batch * accumulation steps * world size.

Pure functions, so the rule is tested without a process group. With the
``elasticity`` section enabled, ``resolve_elastic_batch_sizes`` chooses all
three keys instead (the search itself is in ``elastic``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

from .elastic import ElasticityConfig, elastic_batch_size, elastic_micro_batch

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


class BatchSizes(NamedTuple):
    """The three resolved batch keys, and which of them were derived rather than given."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    derived: Tuple[str, ...]


def _divide(total: int, total_key: str, divisor: int, divisor_text: str, target: str) -> int:
    if total % divisor:
        raise ValueError(
            f"{total_key}: {total} is not divisible by {divisor_text} = {divisor}, "
            f"so {target} cannot be derived"
        )
    return total // divisor


def resolve_batch_sizes(
    train_batch_size: Optional[int],
    micro_batch_size: Optional[int],
    gradient_accumulation_steps: Optional[int],
    world_size: int,
) -> BatchSizes:
    """Fill in the batch keys that were not given (None) from those that were.

    Any two imply the third. ``train_batch_size`` alone means one accumulation
    step, ``micro_batch_size`` alone likewise; ``gradient_accumulation_steps``
    alone, or nothing, is an error. Raises ``ValueError`` whose message starts
    with the offending key path and shows the arithmetic.
    """
    tbs, micro, gas, world = (
        train_batch_size,
        micro_batch_size,
        gradient_accumulation_steps,
        world_size,
    )
    if tbs is None and micro is None:
        given = f"only {GAS} was given" if gas is not None else "none was given"
        raise ValueError(f"{TBS}: give {TBS} or {MICRO} (or both, with or without {GAS}); {given}")
    derived = []
    if gas is None and (tbs is None or micro is None):
        gas = 1
        derived.append(GAS)
    if micro is None:
        micro = _divide(tbs, TBS, gas * world, f"{GAS} {gas} * world size {world}", MICRO)
        derived.append(MICRO)
    elif gas is None:
        gas = _divide(tbs, TBS, micro * world, f"{MICRO} {micro} * world size {world}", GAS)
        derived.append(GAS)
    elif tbs is None:
        tbs = micro * gas * world
        derived.append(TBS)
    elif tbs != micro * gas * world:
        raise ValueError(
            f"{TBS}: {tbs} != {MICRO} {micro} * {GAS} {gas} * world size {world} = "
            f"{micro * gas * world}; the three must multiply out"
        )
    return BatchSizes(tbs, micro, gas, tuple(sorted(derived, key=(TBS, MICRO, GAS).index)))


def resolve_elastic_batch_sizes(
    elastic: ElasticityConfig, world_size: int, given: Sequence[str] = ()
) -> Tuple[BatchSizes, Tuple[int, ...]]:
    """The three batch keys chosen by an enabled ``elasticity`` section at ``world_size``, and every world
    size the chosen global batch suits.

    ``given`` names the batch keys the config also set: refused, since the section decides them, unless
    ``ignore_non_elastic_batch_info`` (the caller then warns that they are ignored). Raises
    ``ValueError`` whose lines start with a key path.
    """
    if given and not elastic.ignore_non_elastic_batch_info:
        raise ValueError(
            "\n".join(
                f"{key}: set while elasticity is enabled, which chooses the batch sizes itself; remove it, or set "
                "elasticity.ignore_non_elastic_batch_info to true to have it ignored"
                for key in given
            )
        )
    try:
        batch, valid = elastic_batch_size(
            elastic.max_train_batch_size,
            elastic.micro_batch_sizes,
            elastic.min_gpus,
            elastic.max_gpus,
            elastic.num_gpus_per_node,
            elastic.prefer_larger_batch,
            elastic.version,
        )
        micro, gas = elastic_micro_batch(batch, elastic.micro_batch_sizes, world_size, valid)
    except ValueError as error:
        raise ValueError(f"elasticity: {error}") from None
    return BatchSizes(batch, micro, gas, (TBS, MICRO, GAS)), tuple(valid)
