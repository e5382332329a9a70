"""The ``compile`` section: torch.compile of the engine's model (``engine.compile``).

DeepSpeed has spelled this section two ways. Releases 0.14-0.16 read ``enabled``, ``backend`` and
``kwargs``: with ``enabled`` the engine compiled its model by itself. Later releases read DeepCompile's
keys (``deepcompile`` and the passes it tunes) and compile only when the script calls
``engine.compile()``. zengine honours the first form (``enabled`` compiles at ``initialize``, with
``backend`` and ``kwargs``), and of the second refuses ``deepcompile: true`` by name
(``unsupported.py``: DeepCompile rewrites ZeRO's own communication into the graph, which zengine does
not do); the DeepCompile-only keys act only with it, so they are accepted and reported as ignored.
"""

from __future__ import annotations

from typing import Any, Dict

from pydantic import Field, field_validator

from .base import Flag, _Section


class CompileConfig(_Section):
    """torch.compile settings that ``initialize`` applies (DeepSpeed 0.14-0.16's section)."""

    enabled: Flag = Field(
        False,
        description=(
            "Compile the model at initialize, as engine.compile(backend, kwargs) would: stages 0-2 compile the "
            "whole model, stage 3 each gather unit's forward with the gather hooks outside the compiled code."
        ),
    )
    backend: str = Field(
        "inductor",
        description=(
            "torch.compile's backend by name (\"inductor\", \"aot_eager\", \"eager\", or any registered "
            "backend)."
        ),
    )
    kwargs: Dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "More torch.compile keywords (mode, fullgraph, dynamic, options); a \"backend\" here is refused: "
            "give it as backend."
        ),
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        import torch._dynamo  # (deferred: dynamo's import is slow, and only a compile section needs it)

        known = torch._dynamo.list_backends(exclude_tags=())
        if value not in known:
            raise ValueError(
                f"unknown torch.compile backend {value!r}; registered backends: {', '.join(known)}"
            )
        return value

    @field_validator("kwargs")
    @classmethod
    def _no_backend_in_kwargs(cls, value: Dict[str, Any]) -> Dict[str, Any]:
        if "backend" in value:
            raise ValueError('"backend" belongs in compile.backend, not in compile.kwargs; move it')
        return value
