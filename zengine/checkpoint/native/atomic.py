"""Crash-safe directory publishing: stage, fsync, rename.

A save writes into ``save_dir/.tmp-<tag>-<random>/``. Only when every file is
fsynced does rank 0 rename it to ``save_dir/<tag>`` (an old ``<tag>`` is
first renamed aside to ``.trash-<tag>-<random>`` and removed afterwards) and
then replace ``latest`` through a temporary file and ``os.replace``. A crash
at any point leaves the previous checkpoint and ``latest`` as they were;
between the two renames ``<tag>`` is briefly absent, and ``resolve`` then
finds it under its trash name.

A killed save leaves its staging directory behind; the next save of any tag
removes every such leftover (``make_staging_dir``). ``find`` is how a load
turns ``save_dir`` and a tag (or ``latest``) into a directory, with an error
that says which of them is missing.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
from typing import Optional

from ...log import logger
from ..errors import CheckpointFileError, CheckpointNotFoundError

LATEST = "latest"
STAGING_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"
# what make_staging_dir and publish name their directories: the prefix, the tag, 8 random hex digits
_PROTOCOL_NAME = re.compile(r"\.(tmp|trash)-.+-[0-9a-f]{8}")
_STAGING_NAME = re.compile(re.escape(STAGING_PREFIX) + r".+-[0-9a-f]{8}")


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_protocol_name(tag: str) -> bool:
    """Whether ``tag`` has the form of a staging or trash directory name, which the protocol reserves."""
    return _PROTOCOL_NAME.fullmatch(tag) is not None


def remove_stale_staging(save_dir: str) -> list[str]:
    """Remove the staging directories that killed saves left in ``save_dir`` (of any tag); return their names.

    Called by the writer (rank 0) just before it creates its own staging directory, so the save in
    progress keeps its files; one job saves into a directory at a time.
    """
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if _STAGING_NAME.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def make_staging_dir(save_dir: str, tag: str) -> str:
    """Create ``save_dir/.tmp-<tag>-<random>``, first removing what killed saves (of any tag) left."""
    os.makedirs(save_dir, exist_ok=True)
    removed = remove_stale_staging(save_dir)
    if removed:
        logger.info(
            f"save_checkpoint: removed {len(removed)} folder(s) that interrupted saves left in "
            f"{save_dir}: {', '.join(removed)}"
        )
    path = os.path.join(save_dir, f"{STAGING_PREFIX}{tag}-{secrets.token_hex(4)}")
    os.mkdir(path)
    return path


def discard(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def publish(staging: str, save_dir: str, tag: str, save_latest: bool = True) -> str:
    """Rename the complete ``staging`` directory to ``save_dir/tag``; then point ``latest`` at it."""
    fsync_dir(staging)
    final = os.path.join(save_dir, tag)
    trash = None
    if os.path.exists(final):
        trash = os.path.join(save_dir, f"{TRASH_PREFIX}{tag}-{secrets.token_hex(4)}")
        os.rename(final, trash)
    os.rename(staging, final)
    fsync_dir(save_dir)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    if save_latest:
        write_latest(save_dir, tag)
    return final


def write_latest(save_dir: str, tag: str) -> None:
    write_text(save_dir, LATEST, tag)


def write_text(directory: str, name: str, text: str, mode: int = 0o644) -> None:
    """Write ``directory/name`` atomically: whole or as it was."""
    tmp = os.path.join(directory, f".{name}-{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, os.path.join(directory, name))
    fsync_dir(directory)


def read_latest(save_dir: str) -> Optional[str]:
    """The tag ``latest`` names, or None when there is no ``latest`` file."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def resolve(save_dir: str, tag: str) -> Optional[str]:
    """The directory of checkpoint ``tag``: ``save_dir/tag``, or the trash copy a crash between the two
    renames of an overwrite left behind; None when neither exists."""
    final = os.path.join(save_dir, tag)
    if os.path.isdir(final):
        return final
    trashed = sorted(
        glob.glob(os.path.join(glob.escape(save_dir), f"{TRASH_PREFIX}{glob.escape(tag)}-*"))
    )
    return trashed[-1] if trashed else None


def find(load_dir: str, tag: Optional[str] = None) -> str:
    """The directory of checkpoint ``tag`` in ``load_dir`` (default: the tag ``latest`` names).

    Raises CheckpointNotFoundError when ``load_dir``, its ``latest`` (tag None) or the tag's directory does
    not exist, and CheckpointFileError when ``latest`` is empty (a save never leaves it so).
    """
    if not os.path.isdir(load_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} does not exist")
    latest = os.path.join(load_dir, LATEST)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise CheckpointNotFoundError(
                f"{latest} does not exist, so there is no latest checkpoint in "
                f"{load_dir}; pass tag= to load a given one"
            )
        if not tag:
            raise CheckpointFileError(
                f"{latest} is empty: it should hold the tag of the checkpoint to load; "
                f"write the tag into it, or pass tag="
            )
        directory = resolve(load_dir, tag)
        if directory is None:
            raise CheckpointNotFoundError(
                f"{latest} names checkpoint {tag!r}, but {os.path.join(load_dir, tag)} "
                f"does not exist; pass the tag of a checkpoint that does"
            )
        return directory
    directory = resolve(load_dir, str(tag))
    if directory is None:
        raise CheckpointNotFoundError(
            f"there is no checkpoint {tag!r} in {load_dir}: "
            f"{os.path.join(load_dir, str(tag))} does not exist"
        )
    return directory
