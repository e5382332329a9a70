"""What a boundary step does when the gradient is not finite (a NaN or Inf loss, an fp16 overflow).

By default the step is skipped on every rank in every precision (the ranks
agree: the norm comes from one all-reduce), counted, and logged: a warning
on the first skip and then every ``warn_every`` skips (fp16 overflows, a
normal part of dynamic loss scaling, are logged at info level). With
``skip: false`` fp32/bf16 steps are applied anyway, for users who want
that; fp16 with dynamic scaling always skips, as the scale search needs it.
``max_consecutive_skips`` skips in a row raise ``NonFiniteGradientError``
naming the first parameter whose gradient went non-finite: a run that
skips every step is not training, and should stop rather than burn time.
"""

from __future__ import annotations

import logging
from typing import Callable

logger = logging.getLogger("zengine")


class NonFiniteGradientError(RuntimeError):
    """Too many boundary steps in a row had a non-finite gradient."""


class NonFinitePolicy:
    """Decides, step by step, whether a non-finite gradient skips the step; counts and reports skips."""

    def __init__(
        self,
        skip: bool = True,
        max_consecutive_skips: int = 50,
        warn_every: int = 100,
        rank: int = 0,
    ):
        self.skip = skip
        self.max_consecutive = max_consecutive_skips  # 0: never raise
        self.warn_every = max(1, warn_every)
        self.rank = rank
        self.skipped = 0  # steps skipped for a non-finite gradient since the start
        self.consecutive = 0  # ... in a row, up to the last step

    def applies(
        self,
        finite: bool,
        norm: float,
        fp16_dynamic: bool,
        locate: Callable[[], str],
        describe: str = "",
    ) -> bool:
        """True when the step should be applied. Raises after too many consecutive skips."""
        if finite:
            self.consecutive = 0
            return True
        if not (fp16_dynamic or self.skip):
            return True
        self.skipped += 1
        self.consecutive += 1
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            name = locate()
            raise NonFiniteGradientError(
                f"zengine: {self.consecutive} boundary steps in a row had a non-finite gradient (global norm "
                f"{norm}); the first parameter whose gradient is non-finite is {name!r}. The model or the data "
                f"produce NaN/Inf (a too-high learning rate, a log of 0, fp16 range?); fix that, or raise "
                f"nonfinite_gradients.max_consecutive_skips (0 never stops)."
            )
        if self.rank == 0 and (self.skipped == 1 or self.skipped % self.warn_every == 0):
            log = logger.info if fp16_dynamic else logger.warning
            log(
                "zengine: step skipped: the gradient is not finite (global norm %s)%s; %d step(s) skipped so far "
                "(next message after %d more)",
                norm,
                describe,
                self.skipped,
                self.warn_every,
            )
        return False

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.consecutive = int(state.get("consecutive", 0))
