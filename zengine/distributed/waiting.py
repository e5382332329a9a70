"""Ranks stuck in different collectives: a deadlock, named within seconds instead of at ``comm_timeout``.

Collectives pair up by order. When one rank runs a collective its peers do not (at stage 3, a module
re-gathered in backward on the ranks where its parameters get a gradient, and not where its output
was detached or unused), the ranks end up waiting in different collectives, each for the other, until
``comm_timeout`` (300 s by default) ends the job with a timeout that says little. On gloo a rank waits
in slices (``collectives.Pending``); once it has waited ``PUBLISH_AFTER`` slices it writes which
collective it waits in to the store, and every ``COMPARE_EVERY`` slices after that it reads the
others'. Two ranks that have each waited that long in *different* collectives cannot both finish: a
collective that one rank has entered completes as soon as every rank has entered it, and a rank waits
in a later collective only after its earlier ones ran. So both raise, naming where every rank waits.
A rank that is merely slow (computing, not waiting) has no record and is waited for.

The cost: nothing for a wait shorter than ``PUBLISH_AFTER`` slices; a few store round trips per
second of a longer one.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from . import diagnose

PUBLISH_AFTER = 2  # slices (seconds) of waiting before this rank says where it waits
COMPARE_EVERY = 2  # then, every this many slices, it compares with the other ranks' records
_KEY = "zengine/" + diagnose._ATTEMPT + "/waiting/{}"
STAGE3_HINT = (
    "At stage 3 a module is gathered again in backward only on the ranks where its parameters get "
    "a gradient: if a module's output is detached, skipped or unused on some ranks, make the loss "
    "depend on it on every rank (multiply by 0 rather than detach or skip), or mark a module around "
    "it a leaf (zengine.utils.set_z3_leaf_modules) so that it is gathered as one unit."
)


class LongWait:
    """One wait of this rank in one collective, told to the others once it has lasted a while."""

    __slots__ = ("what", "group", "slices", "published")

    def __init__(self, what: str, group=None):
        self.what = what  # the collective's description (name, shape, dtype)
        self.group = _group_name(group)  # records are compared within one group only
        self.slices = 0
        self.published = False

    def tick(self, compare_now: bool = False) -> None:
        """After each slice of waiting: publish, then compare; raises when the ranks wait in different ones.
        ``compare_now``: a peer has left (perhaps having found this divergence first): compare at once."""
        self.slices += 1
        if self.slices < PUBLISH_AFTER and not (compare_now and self.published):
            return
        store = diagnose.default_store()
        if store is None or not dist.is_initialized():
            return
        rank = dist.get_rank()
        if not self.published:
            try:
                store.set(
                    _KEY.format(rank),
                    json.dumps(
                        {"what": self.what, "group": self.group, "where": diagnose.context()}
                    ),
                )
                self.published = True
            except Exception:  # the store's host is gone: the peer-departed check names that
                return
            return
        if (self.slices - PUBLISH_AFTER) % COMPARE_EVERY and not compare_now:
            return
        waits = {
            r: w
            for r, w in _records(store, dist.get_world_size()).items()
            if w.get("group") == self.group
        }
        if any(r != rank and w["what"] != self.what for r, w in waits.items()):
            raise _diverged(self.what, rank, waits)

    def done(self) -> None:
        """The wait is over: withdraw the record (a failed wait leaves it, for the peers' reports)."""
        if self.published:
            try:
                diagnose.default_store().delete_key(_KEY.format(dist.get_rank()))
            except Exception:
                pass


def _group_name(group) -> str:
    """Which process group a wait is in (ranks waiting in collectives of different groups are not compared)."""
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return "-".join(map(str, sorted(dist.get_process_group_ranks(group))))
    except Exception:
        return str(id(group))


def _records(store, world: int) -> dict[int, dict]:
    out = {}
    for r in range(world):
        try:
            if store.check([_KEY.format(r)]):
                out[r] = json.loads(store.get(_KEY.format(r)))
        except Exception:
            continue
    return out


def _diverged(what: str, rank: int, waits: dict[int, dict]) -> BaseException:
    if diagnose.first_reported() is not None:
        return diagnose.first_reported()
    world = dist.get_world_size()
    lines = []
    for r in range(world):
        w = waits.get(r)
        mark = " (this rank)" if r == rank else ""
        lines.append(
            f"  rank {r}{mark}: "
            + (
                f"waiting in {w['what']}" + (f" ({w['where']})" if w["where"] else "")
                if w is not None
                else "not waiting in a collective (busy elsewhere)"
            )
        )
    hint = (
        "\n" + STAGE3_HINT
        if any("stage-3 gather" in (w.get("where") or "") for w in waits.values())
        else ""
    )
    error = diagnose.CollectiveTimeoutError(
        "zengine: the ranks are waiting in different collectives, each for the others: they ran different "
        "collectives (a deadlock, named before comm_timeout).\n" + "\n".join(lines) + hint
    )
    diagnose.exchange(diagnose.current("failed", what), rank, world)  # ends the peers' waits too
    diagnose.set_reported(error)
    return error
