"""Per-parameter step counts: a parameter no rank gave a gradient is not stepped, as in torch.

torch's optimizers keep their state per parameter and skip one whose ``.grad`` is None: its step
count, moments, momentum buffer and weight decay stay as they were, and its moments or momentum
buffer are created at its first real step. zengine's wrapped optimizer sees one flat shard per group,
so this module keeps what torch keeps per parameter and plans how each group steps:

- every piece of the group that this rank owns got a gradient and all have stepped equally often
  (nearly always): the flat shard steps as one parameter (``Plan.uniform`` is that count);
- else the group steps in *runs*: maximal ranges of used pieces with the same count. An optimizer
  that steps ranges itself (``ShardOptimizer.steps_runs``: CPUAdam and the NVMe-swapped Adams) is
  given them with their step numbers; any other torch optimizer is handed, for that one step, a view
  of the shard per run with the run's slice of the per-element states and the other states (``step``,
  NAdam's ``mu_product``...) of the run's count (``RunStepper``).

The counts are the same on every rank (the used flags come from the step's all-reduce), so they are
kept per parameter and saved by name in checkpoints, which reshard freely.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass(frozen=True)
class Run:
    """Master elements [lo, hi) whose parameters have all stepped ``count`` times before this step."""

    lo: int
    hi: int
    count: int


@dataclass(frozen=True)
class Plan:
    """How one group steps: whole at ``uniform`` steps taken, else by ``runs`` (used pieces only)."""

    uniform: Optional[int]
    runs: tuple[Run, ...]


def is_elementwise(value: Any, like: torch.Tensor) -> bool:
    """A state entry with one value per element of ``like`` (exp_avg, momentum_buffer...)."""
    return torch.is_tensor(value) and value.shape == like.shape


def _placed(group: dict, shard: torch.Tensor, scalars: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``scalars`` placed as torch's ``Optimizer.load_state_dict`` places them: ``step`` on the
    host unless the optimizer is fused or capturable (then on the parameter's device, as its kernels
    require), every other tensor on the parameter's device."""
    on_device = bool(group.get("fused") or group.get("capturable"))
    out = {}
    for k, v in scalars.items():
        if not torch.is_tensor(v):
            out[k] = copy.deepcopy(v)
        elif k == "step":
            out[k] = v.to(device=shard.device if on_device else "cpu", copy=True)
        else:
            out[k] = v.to(device=shard.device, copy=True)
    return out


class StepCounts:
    """How many optimizer steps each trainable parameter has taken, and the plans made from them."""

    def __init__(self, groups: list):
        self.groups = groups
        self.counts = [[0] * len(g.params) for g in groups]  # per group, per parameter

    def plan(self, gi: int, used: list[bool]) -> Plan:
        """Group ``gi``'s plan for a step in which ``used[pi]`` says whether any rank gave parameter pi a gradient."""
        counts = self.counts[gi]
        pieces = self.groups[gi].master_pieces()  # (pi, lo, hi) in master order
        runs: list[Run] = []
        for pi, lo, hi in pieces:
            if not used[pi]:
                continue
            if runs and runs[-1].hi == lo and runs[-1].count == counts[pi]:
                runs[-1] = Run(runs[-1].lo, hi, counts[pi])
            else:
                runs.append(Run(lo, hi, counts[pi]))
        whole = bool(pieces) and len(runs) == 1 and all(used[pi] for pi, _, _ in pieces)
        return Plan(runs[0].count if whole else None, tuple(runs))

    def advance(self, gi: int, used: list[bool]) -> None:
        """After a step: every used parameter of group ``gi`` has stepped once more."""
        self.counts[gi] = [c + 1 if u else c for c, u in zip(self.counts[gi], used)]

    def owned_counts(self, gi: int) -> set[int]:
        """The counts of the pieces this rank owns in group ``gi``."""
        return {self.counts[gi][pi] for pi, _, _ in self.groups[gi].master_pieces()}

    # -- checkpoints: by name, so that they reshard ----------------------------------------------
    def state_dict(self, gi: int) -> dict[str, int]:
        return dict(zip(self.groups[gi].param_names(), self.counts[gi]))

    def load_state_dict(self, gi: int, saved: Optional[dict[str, int]], fallback: int) -> None:
        """Counts by name; ``fallback`` for a checkpoint that has none (every parameter stepped alike)."""
        names = self.groups[gi].param_names()
        self.counts[gi] = [
            int(saved[n]) if saved is not None and n in saved else fallback for n in names
        ]


class RunStepper:
    """Steps any torch optimizer by runs: one view of the shard per run, for the duration of one ``step()``.

    The flat state keeps the per-element tensors whole; its other entries (``step``...) belong to one
    count, ``flat_count``. The other entries of every other count that pieces of this rank still have
    are kept here, ``scalars[gi][count]``.
    """

    def __init__(self, counts: StepCounts, owner: Optional[Sequence[int]] = None):
        self.counts = counts
        n = len(counts.groups)
        # the wrapped optimizer's param group each group's shard sits in (sub_groups.GroupMap)
        self.owner = list(owner) if owner is not None else list(range(n))
        self.flat_count: list[int] = [
            0
        ] * n  # the count the flat state's non-element entries belong to
        self.scalars: list[dict[int, dict[str, Any]]] = [{} for _ in range(n)]

    def step(
        self, optimizer: torch.optim.Optimizer, shards: list[torch.Tensor], plans: list[Plan]
    ) -> None:
        """One ``optimizer.step()`` over every group: whole where the plan is uniform, else by runs."""
        held: dict[int, list[torch.Tensor]] = {}  # param group -> its groups' shards, in order
        for gi, pg in enumerate(self.owner):
            held.setdefault(pg, []).append(shards[gi])
        for pg, expected in held.items():
            params = optimizer.param_groups[pg]["params"]
            if len(params) != len(expected) or any(p is not s for p, s in zip(params, expected)):
                raise RuntimeError(
                    f"zengine: the wrapped optimizer's param group {pg} does not hold its flat shards"
                )
        stepped: dict[int, list[torch.Tensor]] = {pg: [] for pg in held}
        swapped = []
        for gi, (shard, plan) in enumerate(zip(shards, plans)):
            if plan.uniform is not None:
                self._prepare_whole(optimizer, gi, shard, plan.uniform)
                stepped[self.owner[gi]].append(shard)
            else:
                views = self._views(optimizer, gi, shard, plan.runs)
                stepped[self.owner[gi]] += [v for _, v in views]
                swapped.append((gi, shard, views))
        for pg, params in stepped.items():
            optimizer.param_groups[pg]["params"] = params
        try:
            optimizer.step()
        finally:
            for pg, params in held.items():
                optimizer.param_groups[pg]["params"] = params
            for gi, shard, views in swapped:
                self._absorb(optimizer, gi, shard, views)
        for gi, plan in enumerate(plans):
            if plan.uniform is not None:
                self.flat_count[gi] = plan.uniform + 1

    def prune(self, gi: int) -> None:
        """Forget the states of counts no piece of this rank has any more (after ``StepCounts.advance``)."""
        live = self.counts.owned_counts(gi)
        self.scalars[gi] = {
            c: s for c, s in self.scalars[gi].items() if c in live and c != self.flat_count[gi]
        }

    def _flat_scalars(self, optimizer, shard) -> dict[str, Any]:
        return {
            k: v for k, v in optimizer.state.get(shard, {}).items() if not is_elementwise(v, shard)
        }

    def scalars_of(self, optimizer, gi: int, shard, count: int) -> dict[str, Any]:
        """The non-element state entries of a piece that has stepped ``count`` times.

        A count this rank has no record of (a checkpoint written by an optimizer that steps runs itself,
        as CPUAdam, keeps only the counts) is derived from the flat entries with ``step`` set to it: exact
        for every torch optimizer whose only such entry is ``step`` (Adam, AdamW, SGD, Adagrad, RMSprop...)."""
        if count == self.flat_count[gi]:
            return self._flat_scalars(optimizer, shard)
        known = self.scalars[gi].get(count)
        if known is not None:
            return known
        derived = dict(self._flat_scalars(optimizer, shard))
        if "step" in derived:
            step = derived["step"]
            derived["step"] = (
                torch.full_like(step, count) if torch.is_tensor(step) else type(step)(count)
            )
        return derived

    def _prepare_whole(self, optimizer, gi: int, shard, count: int) -> None:
        """Before the whole shard steps at ``count``: its flat state's other entries are that count's."""
        if count == self.flat_count[gi]:
            return
        if (
            count == 0
        ):  # nothing of this rank's shard ever stepped: a fresh state, as torch's first step
            optimizer.state.pop(shard, None)
        else:
            scalars = _placed(
                optimizer.param_groups[self.owner[gi]],
                shard,
                self.scalars_of(optimizer, gi, shard, count),
            )
            state = optimizer.state[shard]
            for k in [k for k, v in state.items() if not is_elementwise(v, shard)]:
                del state[k]
            state.update(scalars)
        self.flat_count[gi] = count

    def _views(self, optimizer, gi: int, shard, runs) -> list[tuple[Run, torch.Tensor]]:
        flat = optimizer.state.get(shard, {})
        elementwise = {k: v for k, v in flat.items() if is_elementwise(v, shard)}
        views = []
        for run in runs:
            view = shard.detach()[run.lo : run.hi]
            view.grad = shard.grad[run.lo : run.hi]
            if run.count > 0:  # a run never stepped gets no state: the optimizer makes it fresh
                state = {k: t[run.lo : run.hi] for k, t in elementwise.items()}
                state.update(
                    _placed(
                        optimizer.param_groups[self.owner[gi]],
                        shard,
                        self.scalars_of(optimizer, gi, shard, run.count),
                    )
                )
                optimizer.state[view] = state
            views.append((run, view))
        return views

    def _absorb(self, optimizer, gi: int, shard, views) -> None:
        """After the step: each run's state into the flat state (new tensors copied in) and the scalars."""
        flat = optimizer.state[shard]
        for run, view in views:
            scalars = self.scalars[gi].setdefault(
                run.count + 1, {}
            )  # (empty for SGD: its only state is per element)
            for k, value in optimizer.state.pop(view, {}).items():
                if is_elementwise(value, view):
                    target = flat.get(k)
                    if not is_elementwise(target, shard):
                        target = flat[k] = torch.zeros(
                            shard.shape, dtype=value.dtype, device=value.device
                        )
                    part = target[run.lo : run.hi]
                    if value.data_ptr() != part.data_ptr():
                        part.copy_(value)
                else:
                    scalars[k] = value
        if not flat:
            optimizer.state.pop(shard, None)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self, optimizer, gi: int, shard) -> dict[int, dict[str, Any]]:
        """The other entries of every count this rank's pieces have (on the host)."""
        out = {}
        for c in self.counts.owned_counts(gi):
            if c > 0:
                out[c] = {
                    k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                    for k, v in self.scalars_of(optimizer, gi, shard, c).items()
                }
        return out

    def load_state_dict(
        self, group: dict, gi: int, shard, saved: Optional[dict], flat_count: int
    ) -> None:
        """After a checkpoint filled the flat state (its non-element entries being ``flat_count``'s);
        ``group``: the param group of group ``gi``'s shard."""
        self.flat_count[gi] = flat_count
        self.scalars[gi] = {int(c): _placed(group, shard, s) for c, s in (saved or {}).items()}


def used_by_group(groups: list, used_counts: list[float]) -> list[list[bool]]:
    """Per group, per parameter: whether any rank gave it a gradient since the last step, from the
    step's summed used flags (``used_counts``, every group's parameters in order)."""
    out, k = [], 0
    for g in groups:
        out.append([c > 0 for c in used_counts[k : k + len(g.params)]])
        k += len(g.params)
    return out
