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
