"""Crash-safe directory publishing: stage, fsync, rename.

A save writes into ``save_dir/.tmp-<tag>-<random>/``. Only when every file is
fsynced does rank 0 rename it to ``save_dir/<tag>`` (an old ``<tag>`` is
first renamed aside to ``.trash-<tag>-<random>`` and removed afterwards) and
then replace ``latest`` through a temporary file and ``os.replace``. A crash
at any point leaves the previous checkpoint and ``latest`` as they were;
between the two renames ``<tag>`` is briefly absent, and ``resolve`` then
finds it under its trash name.
"""
from __future__ import annotations

import glob
import os
import secrets
import shutil
from typing import Optional

LATEST = "latest"


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_staging_dir(save_dir: str, tag: str) -> str:
    """Create ``save_dir/.tmp-<tag>-<random>`` (removing what crashed saves of the same tag left)."""
    os.makedirs(save_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(save_dir), f".tmp-{glob.escape(tag)}-*")):
        shutil.rmtree(stale, ignore_errors=True)
    path = os.path.join(save_dir, f".tmp-{tag}-{secrets.token_hex(4)}")
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
        trash = os.path.join(save_dir, f".trash-{tag}-{secrets.token_hex(4)}")
        os.rename(final, trash)
    os.rename(staging, final)
    fsync_dir(save_dir)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    if save_latest:
        write_latest(save_dir, tag)
    return final


def write_latest(save_dir: str, tag: str) -> None:
    tmp = os.path.join(save_dir, f".{LATEST}-{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))
    fsync_dir(save_dir)


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
    trashed = sorted(glob.glob(os.path.join(glob.escape(save_dir), f".trash-{glob.escape(tag)}-*")))
    return trashed[-1] if trashed else None
