"""``format_config``: the resolved config as ``key.path = value`` lines for the log.

A ``*`` after a value marks one that differs from zengine's (DeepSpeed's)
default, so the few settings a run changed stand out among the many it did not.
Batch keys have no default: a given one is marked ``*``, a derived one
``(derived)``. The engine logs this on rank 0 at start.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, List, Tuple

from pydantic import BaseModel

from .batch import GAS, MICRO, TBS
from .elastic import abbreviate
from .models import ZengineConfig

CHANGED = "*"


def format_config(cfg: ZengineConfig) -> str:
    """Render ``cfg`` one ``key.path = value`` per line, aligned, with changed values marked."""
    reference = ZengineConfig()
    # overlap_comm's default depends on the stage: compare with the default for the stage in use.
    reference.zero_optimization.overlap_comm = cfg.zero_optimization.stage == 3
    rows: List[Tuple[str, str, str]] = []
    for path, value, default in _leaves(cfg, reference, ""):
        if path in (TBS, MICRO, GAS):
            mark = "(derived)" if path in cfg.derived_batch_keys else CHANGED
        else:
            mark = CHANGED if value != default else ""
        rows.append((path, _render(value), mark))
    width = max(len(path) for path, _, _ in rows)
    lines = [f"{path.ljust(width)} = {text} {mark}".rstrip() for path, text, mark in rows]
    if cfg.world_size is not None:
        lines.append(f"(batch sizes resolved for data-parallel world size {cfg.world_size})")
    if cfg.elastic_world_sizes:
        lines.append(f"(elasticity: global batch {cfg.train_batch_size} suits world sizes "
                     f"{abbreviate(cfg.elastic_world_sizes)})")
    if cfg.ignored_keys:
        lines.append(f"(ignored DeepSpeed keys: {', '.join(cfg.ignored_keys)})")
    return "\n".join(lines)


def _leaves(model: BaseModel, reference: Any, prefix: str) -> Iterator[Tuple[str, Any, Any]]:
    """``(path, value, default)`` for every leaf, in field order."""
    for name in type(model).model_fields:
        path = f"{prefix}{name}"
        value = getattr(model, name)
        default = getattr(reference, name, None) if reference is not None else None
        if isinstance(value, BaseModel):
            yield from _leaves(value, default, f"{path}.")
        elif isinstance(value, dict) and value:
            for key, item in value.items():
                yield f"{path}.{key}", item, (default or {}).get(key, _MISSING)
        else:
            yield path, value, default


_MISSING = object()


def _render(value: Any) -> str:
    if isinstance(value, Path):
        value = str(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
