"""Reading state.pt without running it: ``torch.load(..., weights_only=True)`` unless the caller trusts the file.

A pickle names functions and classes that unpickling calls, so a checkpoint from elsewhere could run
any code at load; its checksums prove it is intact, not where it comes from. torch's weights-only
unpickler builds tensors and plain Python values (dict, list, tuple, set, str, bytes, numbers, bool,
None, OrderedDict, torch dtypes, devices and sizes) and refuses every other global. Everything zengine
writes into state.pt is of those types (optimizer hyper-parameters and scalar state, scheduler and loss
scaler states, RNG states: see ``rng.py``); on top of them this module allows NumPy arrays and scalars
of numeric and bool dtypes, which checkpoints before weights-only loading held (NumPy's RNG state) and
which a ``client_state`` may hold. Anything else (an instance of a user's class, an object array, a
function) raises ``CheckpointUntrustedError`` naming the file and what torch refused, unless
``trusted``: then the file is unpickled as ``torch.load(..., weights_only=False)`` does.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

from ..errors import CheckpointUntrustedError

_GLOBAL = re.compile(r"GLOBAL (\S+)")
# torch 2.6 takes (object, "module.name") pairs as safe globals; before, an object under its own name only
_NAMED_GLOBALS = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 6)


def numpy_globals() -> list:
    """NumPy's names a pickled numeric or bool array or scalar needs, for ``torch.serialization.safe_globals``
    (with torch >= 2.6 under both module paths: ``numpy.core`` before NumPy 2, ``numpy._core`` since).
    Empty without NumPy."""
    try:
        import numpy as np
    except ImportError:
        return []
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    kinds = (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.longdouble,
        np.complex64,
        np.complex128,
    )
    out: list = [np.ndarray, np.dtype]
    out += list(
        dict.fromkeys(type(np.dtype(k)) for k in kinds)
    )  # the dtype classes (a dtype is rebuilt by BUILD)
    for name in ("_reconstruct", "scalar"):
        fn = getattr(multiarray, name)
        if _NAMED_GLOBALS:  # a pickle names the module of the NumPy that wrote it
            out += [(fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
        else:
            out.append(fn)
    return out


class _allowed:
    """``torch.serialization.safe_globals(extra)`` that leaves the safe globals exactly as they were on exit
    (torch's own removes every entry it was given, also one the user had added before)."""

    def __init__(self, extra: list):
        self.extra = extra

    def __enter__(self):
        self.before = torch.serialization.get_safe_globals()
        torch.serialization.add_safe_globals([g for g in self.extra if g not in self.before])

    def __exit__(self, *exc):
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(self.before)


def _refused(raw: bytes) -> list[str]:
    """The globals of the pickle that the weights-only unpickler refuses (read statically: nothing runs)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(raw))
    except Exception:  # only for the message
        return []


def _torch_says(message: str) -> str:
    """The part of torch's weights-only error that says what it refused, without its general advice."""
    message = message.split("Check the documentation of torch.load", 1)[0]
    if "WeightsUnpickler error:" in message:
        message = message.split("WeightsUnpickler error:", 1)[1]
    else:  # a blocked module: torch's advice, then its finding in the last paragraph
        message = (
            [p for p in message.split("\n\n") if p.strip()][-1] if message.strip() else message
        )
    message = message.split(" Please use `torch.serialization.add_safe_globals", 1)[
        0
    ]  # (said below)
    return " ".join(message.split()).rstrip(".")


def load_state(raw: bytes, path: str, trusted: bool = False) -> Any:
    """The object ``torch.save`` wrote into ``raw`` (the bytes of ``path``), on the CPU.

    Weights-only unless ``trusted``; a refusal raises CheckpointUntrustedError naming ``path``, what torch
    refused and the way out.
    """
    if trusted:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
    with _allowed(numpy_globals()):
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            says = _torch_says(str(e))
            refused = _refused(raw) or _GLOBAL.findall(says)
            types = f" ({', '.join(dict.fromkeys(refused))})" if refused else ""
            raise CheckpointUntrustedError(
                f"checkpoint file {path} holds objects{types} that a weights-only load refuses (torch: {says}): "
                f"unpickling them could run code named by the file, so nothing of it was loaded. If you trust "
                f"where this checkpoint comes from, load it with load_checkpoint(..., trust_client_state=True), "
                f"or allow your own classes with torch.serialization.add_safe_globals([...]); a client_state of "
                f"tensors and plain Python values (dict, list, tuple, set, str, int, float, bool, None) needs "
                f"neither"
            ) from None
