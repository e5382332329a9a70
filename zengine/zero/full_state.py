"""One parameter's full fp32 value, gradient or optimizer state, whatever the stage shards
(DeepSpeed's ``safe_get_full_fp32_param`` and friends, exported by ``zengine.utils``).

Every rank holds some pieces of a parameter's fp32 master (all of it at stage
0, a shard at stages 1-3): a full value is put together by each rank writing
its pieces into a zeroed tensor of the parameter's size and one all-reduce
(sum) over the ranks, since every element has exactly one owner. So these are
collectives: every rank calls them for the same parameter, in the same order.
Writing (``set_full_*``) needs no communication: every rank is given the
whole value and keeps its pieces.

Which optimizer owns a parameter is looked up in a table of live optimizers
(``register``), not in attributes on the parameter.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from ..distributed import agreement, collectives

# id(parameter) -> (the optimizer, weakly; group index, parameter index); entries go with their parameter
_where: dict[int, tuple] = {}


def register(optimizer) -> None:
    """Make ``optimizer``'s parameters reachable by the functions below (``ZeroOptimizer`` calls it)."""
    ref = weakref.ref(optimizer)
    for gi, g in enumerate(optimizer.groups):
        for pi, p in enumerate(g.params):
            _where[id(p)] = (ref, gi, pi, weakref.ref(p))
            weakref.finalize(p, _where.pop, id(p), None)


def _locate(param: torch.Tensor):
    """(optimizer, group index, parameter index) of a trainable parameter, or None."""
    entry = _where.get(id(param))
    if entry is None or entry[3]() is not param:
        return None
    opt = entry[0]()
    return None if opt is None else (opt, entry[1], entry[2])


def _assemble(
    opt, gi: int, pi: int, local: torch.Tensor, what: str, scale: float = 1.0
) -> torch.Tensor:
    """The full fp32 tensor of parameter pi from this rank's pieces of ``local`` (a master-shaped tensor);
    ``what``: the public call, named if the ranks do not all make it."""
    g = opt.groups[gi]
    shape = g.param_shape(pi)
    out = torch.zeros(
        math.prod(shape), dtype=torch.float32, device=opt.device
    )  # [numel] fp32 on the compute device
    for lo, hi, start in g.param_pieces(pi):
        out[start : start + hi - lo].copy_(local[lo:hi])
    if not g.replicated and opt.world > 1:
        with agreement.collective_call(what, opt.comm_group):
            collectives.all_reduce_sum(out, opt.comm_group)
    if scale != 1.0:
        out.mul_(scale)
    return out.view(shape)


def _scatter(opt, gi: int, pi: int, local: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's pieces of the full ``value`` of parameter pi into ``local``."""
    flat = value.detach().reshape(-1)
    g = opt.groups[gi]
    for lo, hi, start in g.param_pieces(pi):
        local[lo:hi].copy_(flat[start : start + hi - lo])


def get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The whole fp32 master value of ``param`` (collective); None when no engine trains it."""
    found = _locate(param)
    if found is None:
        return None
    opt, gi, pi = found
    with opt.states_resident():  # ZeRO-Infinity: the masters are in the swap file otherwise
        return _assemble(opt, gi, pi, opt.masters[gi], "safe_get_full_fp32_param")


def set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master and its compute-dtype copy to ``value`` (the same on every rank)."""
    found = _locate(param)
    if found is None:
        return
    opt, gi, pi = found
    g = opt.groups[gi]
    if tuple(value.shape) != g.param_shape(pi):
        raise ValueError(
            f"safe_set_full_fp32_param: value has shape {tuple(value.shape)}, the parameter "
            f"{g.param_shape(pi)}"
        )
    with torch.no_grad(), opt.states_resident():
        _scatter(opt, gi, pi, opt.masters[gi], value)
        owned = g.owned_params()
        if g.in_memory and owned.data_ptr() != opt.masters[gi].data_ptr():
            _scatter(opt, gi, pi, owned, value)
        opt.refresh_param(gi, pi, value)  # (shards on NVMe are written from the master there)


def get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The whole gradient of ``param`` as the next step will apply it: averaged over the ranks and
    unscaled, fp32 (collective). Valid after a synchronised backward and before the step, which
    clears gradients; None when no engine trains ``param``."""
    found = _locate(param)
    if found is None:
        return None
    opt, gi, pi = found
    opt.grads.drain()
    return _assemble(
        opt,
        gi,
        pi,
        opt.grads.owned_grad(gi),
        "safe_get_full_grad",
        scale=opt.grads.unscale_held(opt.grad_factor.unscale()),
    )


def get_full_optimizer_state(param: torch.Tensor, key: str) -> Optional[torch.Tensor]:
    """The whole optimizer state ``key`` (e.g. ``exp_avg``) of ``param`` (collective); None when there is
    no such state (before the first step) or no engine trains ``param``."""
    found = _locate(param)
    if found is None:
        return None
    opt, gi, pi = found
    with opt.states_resident():
        state = opt.optimizer.state.get(opt.shard_params[gi], {}).get(key)
        if not torch.is_tensor(state) or state.shape != opt.masters[gi].shape:
            return None  # not yet created (before the first step), or a scalar such as "step"
        return _assemble(opt, gi, pi, state, "safe_get_full_optimizer_state")


def set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, key: str) -> None:
    """Set ``param``'s optimizer state ``key`` to ``value`` (the same on every rank)."""
    found = _locate(param)
    if found is None:
        return
    opt, gi, pi = found
    with opt.states_resident(), torch.no_grad():
        state = opt.optimizer.state.get(opt.shard_params[gi], {}).get(key)
        if not torch.is_tensor(state):
            raise KeyError(
                f"safe_set_full_optimizer_state: the optimizer has no state {key!r} for this "
                "parameter yet (it appears after the first step)"
            )
        _scatter(
            opt, gi, pi, state, value
        )  # (NVMe: states_resident writes the changed moments back)
