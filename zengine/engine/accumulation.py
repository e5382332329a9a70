"""Where the engine stands in a global batch: the micro-steps counted toward the accumulation
boundary, and the script's own say over where the boundary falls."""

from __future__ import annotations

from typing import Optional


class Accumulation:
    """The accumulation state shared by the training loop (``engine.py``) and DeepSpeed's accumulation
    controls (``members.py``)."""

    def __init__(self):
        self.boundary_override: Optional[bool] = (
            None  # set_gradient_accumulation_boundary; None: count
        )
        self.in_progress = False  # micro-steps taken since the last boundary step
        self.backward_since_step = False  # a backward ran since the last step()
        # The micro-step count at which the current run of windows began: 0, or where a resume or a
        # change of accumulation steps put it. Windows are counted from here, not from 0: a count
        # saved with another gradient_accumulation_steps need not be a multiple of today's, and
        # counting it modulo today's would put every later boundary inside a global batch.
        self.window_origin = 0

    def start_window(self, micro_steps: int) -> None:
        """The next micro-step (number ``micro_steps``) begins a global batch: after a checkpoint
        load (the accumulated gradients were not saved) or a change of accumulation steps."""
        self.window_origin = micro_steps
        self.in_progress = False

    def is_boundary(self, micro_steps: int, gradient_accumulation_steps: int) -> bool:
        """True when the next ``step()`` completes a global batch (or as the script said)."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (micro_steps - self.window_origin + 1) % gradient_accumulation_steps == 0

    @property
    def between_batches(self) -> bool:
        """No micro-step or backward of a global batch has happened since its boundary step."""
        return not self.in_progress and not self.backward_since_step
