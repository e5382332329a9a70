"""The engine layer: the ``Engine`` that drives forward, backward and the boundary step
(``engine.py``), what it builds at start (``build.py``), the DeepSpeed members beyond training
(``members.py``) and the bracket around every backward pass (``backward.py``).

``zengine.engine`` is also DeepSpeed's ``deepspeed.runtime.engine`` under the compatibility mode,
hence ``DeepSpeedEngine`` here.
"""

from .engine import DeepSpeedEngine, Engine

__all__ = ["DeepSpeedEngine", "Engine"]
