"""Random number generator states of one rank: Python, NumPy (when installed), torch, CUDA.

``capture`` returns plain types and tensors only, so that state.pt loads with ``torch.load(...,
weights_only=True)``: NumPy's state is kept as its legacy tuple with the key array turned into a list
of ints. Checkpoints written before that hold the NumPy array itself; ``restore`` takes either.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None


def _numpy_state() -> tuple:
    """``np.random.get_state()`` without NumPy types: ('MT19937', [624 ints], pos, has_gauss, cached_gaussian)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return (str(name), keys.tolist(), int(pos), int(has_gauss), float(gauss))


def capture() -> dict[str, Any]:
    """This process's generator states (plain types and tensors: loadable with weights_only=True)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = _numpy_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what ``capture`` returned (generators it did not record are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(
            tuple(state["numpy"])
        )  # the key as a list (now) or an array (older checkpoints)
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        for device in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[device], device)
