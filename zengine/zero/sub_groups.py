"""DeepSpeed's optimizer sub-groups, and which param group of the wrapped optimizer each ZeRO group
belongs to.

A ZeRO group is the unit the step treats alike: one flat master shard, one gradient shard, one home
for its states. Usually it is one of the user's param groups. Two stage-3 cases need finer units, and
cut each param group into sub-groups of whole parameters, each made a group:

- partial offload (``offload/partial.py``): DeepSpeed's sub-groups (``split_sub_groups``: each closed
  once it holds ``sub_group_size`` shard elements), which the placement puts on the device or the host;
- the optimizer on a device with a caching allocator: the gradient buckets (``bucket_sub_groups``), so
  that each group's gradient shard is made when its bucket's reduction lands (``offload/landing.py``)
  and the shards grow as backward goes, as FSDP2 makes each block's sharded gradients when its
  reduce-scatter ends, not all at the first reduction while every activation is still held.

The user still sees their own param groups (the schedule sets their ``lr``, ``engine.get_lr()`` lists
them, checkpoints keep their records): ``GroupMap`` says which one each group's shard parameter sits
in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

from .layout import FlatLayout, gradient_buckets


def split_sub_groups(numels: Sequence[int], size: int) -> list[list[int]]:
    """The indices of ``numels`` (each parameter's shard elements, in order) cut into DeepSpeed's
    sub-groups (``stage3._create_fp16_sub_groups``): one sub-group when they all fit in ``size``,
    else consecutive runs closed as soon as they reach ``size``."""
    if not numels or size >= sum(numels):
        return [list(range(len(numels)))]
    out, run, held = [], [], 0
    for i, n in enumerate(numels):
        run.append(i)
        held += n
        if held >= size or i == len(numels) - 1:
            out.append(run)
            run, held = [], 0
    return out


def bucket_sub_groups(
    numels: Sequence[int], size: int, kinds: Optional[Sequence[Hashable]] = None
) -> list[list[int]]:
    """The indices of ``numels`` (each parameter's shard elements, in order) cut as the gradient
    buckets of ``size`` shard elements cut them (``layout.gradient_buckets``: from the last parameter
    back, at most ``size`` each unless one parameter is larger, one ``kinds`` each), in order: so that
    a group's buckets are one bucket."""
    if not numels:
        return [[]]
    layout = FlatLayout([str(i) for i in range(len(numels))], [(n,) for n in numels], 1)
    return [list(b.params) for b in reversed(gradient_buckets(layout, size, kinds))]


@dataclass(frozen=True)
class GroupMap:
    """``owner[gi]``: the wrapped optimizer's param group that ZeRO group ``gi``'s shard sits in."""

    owner: tuple[int, ...]

    @classmethod
    def identity(cls, groups: int) -> "GroupMap":
        """Each ZeRO group is one param group (every run but partial offload)."""
        return cls(tuple(range(groups)))

    @property
    def count(self) -> int:
        """The wrapped optimizer's param groups."""
        return max(self.owner) + 1 if self.owner else 0

    def members(self, pg: int) -> list[int]:
        """The ZeRO groups in param group ``pg``, in order."""
        return [gi for gi, o in enumerate(self.owner) if o == pg]

    def optimizer_groups(
        self, hypers: Sequence[dict], shard_params: Sequence[torch.Tensor]
    ) -> list[dict]:
        """The wrapped optimizer's param groups: each with the hyper-parameters of its first ZeRO
        group (they are alike) and the shard parameters of all of them."""
        return [
            {**hypers[self.members(pg)[0]], "params": [shard_params[gi] for gi in self.members(pg)]}
            for pg in range(self.count)
        ]
