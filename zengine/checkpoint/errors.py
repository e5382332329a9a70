"""What a failed save or load raises: every message names the checkpoint file or directory concerned."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointFileError(CheckpointError):
    """A checkpoint file is missing, truncated or corrupt; the message names the file."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint was saved from a model with other parameter names or shapes; the message lists them."""


class CheckpointSaveError(CheckpointError):
    """A save failed (a full disk, a permission); the previous checkpoint and ``latest`` are untouched."""
