"""``format_config``: the resolved config as ``key.path = value`` lines for the log.

A ``*`` after a value marks one that differs from zengine's (DeepSpeed's)
default, so the few settings a run changed stand out among the many it did not.
Batch keys have no default: a given one is marked ``*``, a derived one
``(derived)``. The engine logs the changed settings on rank 0 at start, and every
setting when ``ZENGINE_PRINT_CONFIG=full`` is set (``PRINT_FULL_ENV``).
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
PRINT_FULL_ENV = (
    "ZENGINE_PRINT_CONFIG"  # "full": the engine logs every setting, not only the changed ones
)


def format_config(cfg: ZengineConfig, changed_only: bool = False) -> str:
    """Render ``cfg`` one ``key.path = value`` per line, aligned, with changed values marked; with
    ``changed_only`` the changed and derived ones alone, and a count of the others."""
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
    hidden = 0
    if changed_only:
        shown = [row for row in rows if row[2]]
        hidden, rows = len(rows) - len(shown), shown
    width = max((len(path) for path, _, _ in rows), default=0)
    lines = [f"{path.ljust(width)} = {text} {mark}".rstrip() for path, text, mark in rows]
    if hidden:
        lines.append(
            f"({hidden} more settings at their defaults; {PRINT_FULL_ENV}=full logs every one)"
        )
    if cfg.world_size is not None:
        lines.append(f"(batch sizes resolved for data-parallel world size {cfg.world_size})")
    if cfg.elastic_world_sizes:
        lines.append(
            f"(elasticity: global batch {cfg.train_batch_size} suits world sizes "
            f"{abbreviate(cfg.elastic_world_sizes)})"
        )
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
