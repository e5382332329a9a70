"""Writes to the engine's parameters that the engine cannot follow, refused by name at the step.

After ``initialize`` the engine owns each trained parameter's storage: at stages 0-2 it is a view
into its group's flat buffer, whose masters the step updates and publishes; at stage 3 it is the
engine's gathered storage or the empty tensor a partitioned parameter shows. Two writes a script
makes between steps would go nowhere, silently:

- ``p.data = tensor`` (any stage): the module then computes with the new tensor, while the step
  updates the flat buffer (stages 0-2) or the next gather puts the engine's storage back (stage 3);
- at stage 3, an in-place write (``with torch.no_grad(): p.mul_(0.5)``) to a partitioned parameter
  outside a gather: it writes the empty tensor it shows (its version counter moves, nothing else).

Each group notes them (``ParamGroup.lost_writes``: at stages 0-2 the storage address of each
parameter at the step, one pointer read each; at stage 3 what a gather or a release finds before it
swaps the parameter's storage), and ``check_writes`` raises ``ParameterWriteError`` at the next
``engine.step()``, before any update, naming the parameters and the way out. In-place writes at
stages 0-2 reach the flat buffer and are followed (the masters take them, ``optimizer.py``).
"""

from __future__ import annotations

from typing import Sequence


class ParameterWriteError(RuntimeError):
    """A write to a trained parameter after ``initialize`` that the engine cannot follow
    (``p.data = tensor``; at stage 3 an in-place write outside a gather). Raised by
    ``engine.step()`` before any update."""


def check_writes(groups: Sequence) -> None:
    """Raise ``ParameterWriteError`` when a group noted a write it cannot follow."""
    lost = [(name, why) for g in groups for name, why in g.lost_writes()]
    if not lost:
        return
    listed = "; ".join(f"{name} ({why})" for name, why in lost[:8])
    raise ParameterWriteError(
        f"zengine: {len(lost)} parameter(s) were written after zengine.initialize in a way the "
        f"engine cannot follow: {listed}{' ...' if len(lost) > 8 else ''}. The engine keeps each "
        "parameter's values in its own storage (and its masters), so the write would be lost and "
        "training would go on from the old values; nothing was updated. Write in place instead, "
        "gathered at stage 3 and on every rank: `with engine.summon_full_params(): "
        "p.data.copy_(new)` (or `with torch.no_grad(): p.copy_(new)` at stages 0-2), or load the "
        "values with engine.module.load_state_dict inside engine.summon_full_params()"
    )
