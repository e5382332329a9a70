"""Random number generator states of one rank: Python, NumPy (when installed), torch, CUDA."""
from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None


def capture() -> dict[str, Any]:
    """This process's generator states (picklable)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what ``capture`` returned (generators it did not record are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        for device in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[device], device)
