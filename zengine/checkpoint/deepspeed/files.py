"""Reading DeepSpeed's ``*.pt`` checkpoint files without DeepSpeed installed, and without running them.

DeepSpeed pickles a few of its own objects beside the tensors: the loss scaler (an instance), the ZeRO stage
(an enum) and fragment addresses (named tuples). Unpickling them normally imports ``deepspeed``, which a
zengine user need not have, and a pickle may name any code. Here every global under ``deepspeed.`` is
rebuilt as a ``DeepSpeedObject`` stand-in (its class name, constructor arguments and state as plain data),
and everything else goes through torch's weights-only unpickler (tensors and plain values) with the NumPy
types native/safe_load.py allows. Another global (an object of the user's own class in ``client_state``) raises
``CheckpointUntrustedError`` unless the caller trusts the file: then it is unpickled as torch does, the
DeepSpeed globals still stood in for.
"""

from __future__ import annotations

import copyreg
import pickle
from typing import Any

import torch

from ..errors import CheckpointFileError, CheckpointUntrustedError
from ..native.safe_load import _allowed, numpy_globals

_PREFIX = "deepspeed."


class DeepSpeedObject:
    """A DeepSpeed object read without DeepSpeed: ``ds_class`` (its dotted class name), ``args`` (what
    it was called with: an enum's value, a named tuple's fields) and ``state`` (its attributes)."""

    ds_class = ""
    args: tuple = ()  # rebuilt without __init__ (pickle's NEWOBJ) an object keeps these
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        self.state = dict(kwargs)

    def __setstate__(self, state: Any) -> None:
        self.state = state if isinstance(state, dict) else {"state": state}

    def get(self, key: str, default: Any = None) -> Any:
        """An attribute as saved (a loss scaler's ``cur_scale``), else ``default``."""
        return self.state.get(key, default) if isinstance(self.state, dict) else default

    def __int__(self) -> int:  # an IntEnum (ZeRO stage) compares as its value
        return int(self.args[0])

    def __repr__(self) -> str:
        return f"DeepSpeedObject({self.ds_class}, args={self.args!r})"

    def __reduce__(self):
        # pickled as DeepSpeed pickles its own: an enum by its value, an object by its attributes
        if self.args:
            return type(self), tuple(self.args)
        return copyreg.__newobj__, (type(self),), self.state


def make(dotted: str, *args: Any, **state: Any) -> DeepSpeedObject:
    """A stand-in that ``save_ds_file`` writes as DeepSpeed's own class ``dotted`` (so that DeepSpeed, when
    it loads the file, gets its real object): ``make("...ZeroStageEnum", 2)``, ``make("...LossScaler",
    cur_scale=1.0, dynamic=False)``."""
    obj = standin(dotted).__new__(standin(dotted))
    obj.args, obj.state = args, state
    return obj


_STANDINS: dict[str, type] = {}


def standin(dotted: str) -> type:
    """One stand-in class per DeepSpeed class name (so that isinstance checks by name stay possible)."""
    if dotted not in _STANDINS:
        _STANDINS[dotted] = type(
            dotted.rsplit(".", 1)[-1], (DeepSpeedObject,), {"ds_class": dotted}
        )
    return _STANDINS[dotted]


class _TrustedUnpickler(pickle.Unpickler):
    """torch's full unpickler with DeepSpeed's classes stood in for (used only for a trusted file)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith(_PREFIX):
            return standin(f"{module}.{name}")
        return super().find_class(module, name)


class _trusted_pickle:
    """A ``pickle_module`` for ``torch.load`` whose Unpickler stands in for DeepSpeed's classes."""

    Unpickler = _TrustedUnpickler
    load = staticmethod(lambda f, **kw: _TrustedUnpickler(f, **kw).load())
    __name__ = "zengine_deepspeed_pickle"


class _DeepSpeedPickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    """Writes a stand-in's class under DeepSpeed's name (it is not importable under that name here)."""

    def save_global(self, obj, name=None):
        dotted = getattr(obj, "ds_class", "")
        if isinstance(obj, type) and issubclass(obj, DeepSpeedObject) and dotted:
            module, _, qualname = dotted.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


class _writing_pickle:
    """A ``pickle_module`` for ``torch.save`` with that pickler."""

    Pickler = _DeepSpeedPickler
    __name__ = "zengine_deepspeed_pickle"


def save_ds_file(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` as DeepSpeed's files are written, stand-ins (``make``) as DeepSpeed's classes."""
    torch.save(obj, path, pickle_module=_writing_pickle, pickle_protocol=2)


def load_ds_file(path: str, trusted: bool = False) -> Any:
    """The object ``torch.save`` wrote to ``path`` (tensors on the CPU, memory-mapped: only what is read is
    paged in), DeepSpeed's own objects as ``DeepSpeedObject`` stand-ins."""
    try:
        globals_named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # not a torch zip file (truncated, or the legacy format)
        raise CheckpointFileError(
            f"DeepSpeed checkpoint file {path} cannot be read as a torch file ({e}); "
            f"it is truncated or was not written by torch.save"
        ) from e
    deepspeed_names = [g for g in globals_named if g.startswith(_PREFIX)]
    others = [g for g in globals_named if not g.startswith(_PREFIX)]
    if trusted:
        return torch.load(
            path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_trusted_pickle
        )
    extra = numpy_globals() + [(standin(g), g) for g in deepspeed_names]
    with _allowed(extra):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            refused = ", ".join(g for g in others) or str(e).splitlines()[0]
            raise CheckpointUntrustedError(
                f"DeepSpeed checkpoint file {path} holds objects ({refused}) that a weights-only load refuses: "
                f"unpickling them could run code named by the file, so nothing was loaded. If you trust where "
                f"this checkpoint comes from, load it with load_checkpoint(..., trust_client_state=True)"
            ) from None
