"""Where a DCP checkpoint keeps the model, the optimizer and the train state: found from its keys.

DCP stores a nested state_dict flattened to dotted keys. The layouts met in practice:

    PyTorch's tutorial      model.<fqn>, optim.state.<fqn>.<exp_avg|exp_avg_sq|step>,
                            optim.param_groups.<i>.<lr|betas|...|params>   (often under app.)
    torchtitan              <fqn> at the top, optimizer.state.<fqn>.<key>,
                            optimizer.param_groups.<fqn>.<lr|...> (flattened optimizer state),
                            lr_scheduler.<key>, train_state.step, dataloader.*

``find_sections`` takes the saved keys and the model's parameter and buffer names and answers where each
section is, whatever the prefixes: the model section is the prefix under which the model's names are
found, the optimizer's the prefix before ``state.<fqn>.`` of a trained parameter. Pure: no files.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

# the top-level sections of a torchtitan checkpoint that are not model weights
_NOT_MODEL = ("lr_scheduler.", "train_state.", "dataloader.")


@dataclass
class Sections:
    """The DCP keys of one checkpoint, sorted into the parts zengine loads."""

    model: dict[str, str]  # model state_dict key -> DCP key
    optimizer: Optional[str]  # the optimizer's prefix ("optim.", "optimizer.", ...), None: no state
    state: dict[str, dict[str, str]] = field(default_factory=dict)  # fqn -> {state key: DCP key}
    values: set[str] = field(default_factory=set)  # the non-tensor keys

    def hyper_keys(self, names: Sequence[str]) -> dict[str, str]:
        """The hyper-parameter keys of the optimizer group holding ``names``: {name: DCP key}. Nested
        (``param_groups.<i>.<key>``) needs the groups' ``params`` lists: see ``group_lists``."""
        if self.optimizer is None or not names:
            return {}
        flat = f"{self.optimizer}param_groups.{names[0]}."
        return {k[len(flat) :]: k for k in self.values if k.startswith(flat)}

    def group_lists(self) -> list[str]:
        """The ``param_groups.<i>.params`` keys of a nested optimizer state, in group order."""
        if self.optimizer is None:
            return []
        base = f"{self.optimizer}param_groups."
        found = []
        for k in self.values:
            middle = k[len(base) : -len(".params")] if k.startswith(base) else ""
            if k.endswith(".params") and middle.isdigit():
                found.append((int(middle), k))
        return [k for _, k in sorted(found)]

    def nested_hyper_keys(self, index: int) -> dict[str, str]:
        base = f"{self.optimizer}param_groups.{index}."
        return {
            k[len(base) :]: k
            for k in self.values
            if k.startswith(base) and k[len(base) :] != "params"
        }

    def under(self, prefix: str) -> dict[str, str]:
        """Top-level section ``prefix`` (``lr_scheduler.``): {its key: DCP key}."""
        return {k[len(prefix) :]: k for k in self.values if k.startswith(prefix)}


def _ends_with_name(key: str, name: str) -> bool:
    return key == name or key.endswith("." + name)


def find_sections(
    tensor_keys: Iterable[str],
    value_keys: Iterable[str],
    names: Sequence[str],
    trained: Sequence[str],
    paths: Optional[dict[str, tuple]] = None,
) -> Sections:
    """Sort a DCP checkpoint's keys; ``names``: the model's state_dict keys (parameters, tied names,
    buffers), ``trained``: the parameters with optimizer state, ``paths``: DCP's record of each flattened
    key's nesting (``Metadata.planner_data``), when it has one."""
    tensors, values = set(tensor_keys), set(value_keys)
    wanted = set(names)
    prefixes: Counter = Counter()
    for key in tensors:
        for name in wanted:
            if _ends_with_name(key, name):
                prefixes[key[: len(key) - len(name)]] += 1
    if not prefixes:
        return Sections({}, None, values=values)
    best = max(prefixes.values())
    model_prefix = min((p for p, c in prefixes.items() if c == best), key=len)

    optimizer = _optimizer_prefix(tensors, trained)
    depth = (
        len(paths[f"{model_prefix}{names[0]}"])
        if paths and f"{model_prefix}{names[0]}" in paths
        else None
    )
    model = {}
    for key in tensors:
        if not key.startswith(model_prefix):
            continue
        if (
            optimizer is not None
            and key.startswith(optimizer)
            and optimizer.startswith(model_prefix)
        ):
            continue
        if depth is not None and key in paths and len(paths[key]) != depth:
            continue  # another section nested beside the model's (DCP recorded the nesting)
        if model_prefix == "" and key.startswith(_NOT_MODEL):
            continue
        model[key[len(model_prefix) :]] = key
    state: dict[str, dict[str, str]] = {}
    if optimizer is not None:
        base = f"{optimizer}state."
        for name in trained:
            head = f"{base}{name}."
            found = {
                k[len(head) :]: k
                for k in tensors | values
                if k.startswith(head) and "." not in k[len(head) :]
            }
            if found:
                state[name] = found
    return Sections(model, optimizer, state, values)


def _optimizer_prefix(tensors: set[str], trained: Sequence[str]) -> Optional[str]:
    """The prefix before ``state.<fqn>.`` of the trained parameters' state tensors, the most common."""
    found: Counter = Counter()
    for name in trained:
        needle = f"state.{name}."
        for key in tensors:
            at = key.find(needle)
            while at >= 0:
                if at == 0 or key[at - 1] == ".":
                    found[key[:at]] += 1
                    break
                at = key.find(needle, at + 1)
    return found.most_common(1)[0][0] if found else None
