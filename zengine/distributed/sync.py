"""The one place where the training step waits for the device.

A boundary step reads one small tensor back to the host: the global
gradient norm, the non-finite flag, the step fingerprint and the used
flags, all from one all-reduce (``zero/step_stats.py``). Everything else in
forward, backward and the step stays on the device, queued. Routing that
read through ``read_to_host`` lets the CPU guard tests (which run the step
on fake CUDA tensors, where any other read raises) supply its values and
count that it happens once.
"""

from __future__ import annotations

import torch


def read_to_host(t: torch.Tensor) -> list[float]:
    """The values of a small tensor on the host (waits for the device to produce them)."""
    return t.tolist()
