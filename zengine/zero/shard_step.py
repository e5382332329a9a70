"""Stepping the wrapped optimizer over the flat fp32 master shards, as the step counts plan it.

The wrapped optimizer is any ``torch.optim.Optimizer``; what it can do beyond that (step ranges with
their own step numbers, write the parameters while stepping, hold its states in a swap file) it
declares (``ops/shard_optimizer.py``). ``ShardStepper`` holds it with those abilities and steps it:
an optimizer that steps ranges gets each group's runs with their step numbers; any other steps whole
groups whole and the rest by runs (``step_counts.RunStepper``).
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..ops.shard_optimizer import abilities
from .flat_group import ParamGroup
from .step_counts import Plan, RunStepper, StepCounts
from .sub_groups import GroupMap


def shard_runs(groups: list[ParamGroup], shard_params: list, plans: list[Plan]) -> dict:
    """Shard param -> its (lo, hi, step number) runs, for an optimizer that steps ranges
    (``step_runs``)."""
    runs = {}
    for g, sp, plan in zip(groups, shard_params, plans):
        if plan.uniform is not None:  # the whole shard, padding included, as one run
            runs[sp] = [(0, g.owned[1] - g.owned[0], plan.uniform + 1)]
        else:
            runs[sp] = [(r.lo, r.hi, r.count + 1) for r in plan.runs]
    return runs


class ShardStepper:
    """The wrapped optimizer over ``shard_params`` (one flat fp32 parameter per group, sitting in the
    param groups ``group_map`` says), its declared abilities, and how it is stepped."""

    def __init__(
        self,
        groups: list[ParamGroup],
        shard_params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        counts: StepCounts,
        copies,
        copies_out: bool,
        group_map: GroupMap,
    ):
        self.groups = groups
        self.shard_params = shard_params
        self.optimizer = optimizer
        self.abilities = abilities(optimizer)  # what it can do beyond torch.optim.Optimizer
        # steps any torch optimizer by runs when counts differ
        self.run_stepper = RunStepper(counts, group_map.owner)
        self.copies = copies  # the placement's copies (offload/copies.py)
        self.copies_out = copies_out  # the placement lets the step write the parameters as it goes

    @property
    def steps_in_pieces(self) -> bool:
        """One step may be taken in the optimizer's pieces (``step_pieces``)."""
        return self.abilities.steps_runs and self.abilities.steps_in_pieces

    def runs(self, plans: list[Plan]) -> dict:
        """Shard param -> its (lo, hi, step number) runs under ``plans``."""
        return shard_runs(self.groups, self.shard_params, plans)

    def copy_out_targets(self, masters: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """gi -> the compute-dtype parameter slice, for the groups whose parameters the optimizer
        can write while stepping (not a master that is their own storage; on a device, through
        staging: copies.py)."""
        if not (self.abilities.writes_params and self.copies_out):
            return {}
        return {
            gi: g.owned_params()
            for gi, (g, m) in enumerate(zip(self.groups, masters))
            if m.data_ptr() != g.owned_params().data_ptr()
        }

    def step(self, plans: list[Plan], owned: Mapping[int, torch.Tensor]) -> None:
        """Step the wrapped optimizer as the plans say. ``owned`` (``copy_out_targets``): the
        parameter slices it writes as it steps."""
        if not self.abilities.steps_runs:
            self.run_stepper.step(self.optimizer, self.shard_params, plans)
            return
        runs = self.runs(plans)
        copy_out = {
            self.shard_params[gi]: self.copies.copy_out_target(gi, o) for gi, o in owned.items()
        }
        if copy_out:
            # CPUAdam writes the updated master into the compute-dtype parameters in the same pass
            # (on a GPU, into pinned staging that the placement's copies then upload).
            self.copies.before_step()
            self.abilities.step_runs(runs, copy_out)
            self.copies.after_step()
        else:
            self.abilities.step_runs(runs, {})
