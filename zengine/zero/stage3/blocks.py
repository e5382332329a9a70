"""The model's repeated blocks, which bound stage 3's gather groups (``trace.gather_groups``).

FSDP2 users wrap each transformer block; DeepSpeed users name nothing and stage 3 gathers module by
module. To gather about a block at a time without being told, the blocks are found the way
Hugging Face's own wrapping policies find them: the classes a ``transformers`` model lists in
``_no_split_modules`` (its decoder layers), else the members of every ``nn.ModuleList`` or
``nn.Sequential`` whose two or more members are all of one class (a stack of layers). The outermost
such modules are the blocks; a gather group never spans two of them, so one collective gathers at
most one block (and at most ``stage3_prefetch_bucket_size`` elements).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

BACKWARD = " (backward)"


def _declared_classes(model: nn.Module) -> set[str]:
    """Class names the model declares as blocks (Hugging Face's ``_no_split_modules``)."""
    found: set[str] = set()
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)):
            found.update(n for n in names if isinstance(n, str))
    return found


def _stacked(container: nn.Module) -> bool:
    """A container of two or more members of one class, each with parameters: a stack of layers."""
    members = list(container.children())
    return (
        len(members) >= 2
        and len({type(m) for m in members}) == 1
        and all(any(True for _ in m.parameters()) for m in members)
    )


def block_names(model: nn.Module) -> list[str]:
    """The qualified names of the model's outermost repeated blocks (see the module doc)."""
    declared = _declared_classes(model)
    blocks: list[str] = []
    for name, m in model.named_modules():
        if not name or any(name.startswith(b + ".") for b in blocks):
            continue
        if type(m).__name__ in declared:
            blocks.append(name)
    if blocks:
        return blocks
    for name, m in model.named_modules():
        if any(name == b or name.startswith(b + ".") for b in blocks):
            continue
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and _stacked(m):
            blocks.extend(f"{name}.{child}" if name else child for child, _ in m.named_children())
    return blocks


class BlockOf:
    """Which block a fetch's tag (a module's name, maybe with `` (backward)``) lies in."""

    def __init__(self, blocks: Sequence[str]):
        self.blocks = sorted(blocks, key=len, reverse=True)

    def __call__(self, tag: str) -> Optional[str]:
        name = tag[: -len(BACKWARD)] if tag.endswith(BACKWARD) else tag
        for b in self.blocks:
            if name == b or name.startswith(b + "."):
                return b
        return None
