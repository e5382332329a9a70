"""What a failed save or load raises: every message names the checkpoint file or directory concerned."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint where a load looked: the load directory, its ``latest`` file or the tag's
    directory does not exist; the message names the path. ``load_checkpoint(..., missing_ok=True)``
    returns ``(None, None)`` instead of raising this (and only this)."""


class CheckpointFileError(CheckpointError):
    """A checkpoint file is missing, truncated, corrupt or edited; the message names the file."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was saved from a model with other parameter names or shapes; the message lists them."""


class CheckpointSaveError(CheckpointError):
    """A save failed (a full disk, a permission); the previous checkpoint and ``latest`` are untouched."""


class CheckpointUntrustedError(CheckpointError):
    """state.pt holds objects that a weights-only load refuses (instances of your own classes in
    ``client_state``, or anything whose unpickling would call code named by the file): they were not
    loaded, and nothing of the file ran. The message names the file and the types; if you trust where
    the checkpoint comes from, ``load_checkpoint(..., trust_client_state=True)`` loads them."""
