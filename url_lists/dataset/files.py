"""Durable file operations: a file is replaced whole or not at all, even across a SIGKILL or a power cut."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(temporary: Path, final: Path) -> None:
    """Rename a written and synced ``temporary`` over ``final``, then sync the directory so the rename lasts."""
    os.replace(temporary, final)
    fsync_path(final.parent)


def temporary_name(final: Path) -> Path:
    """A leading dot: readers of the folder skip it (pyarrow's datasets skip "." and "_" files)."""
    return final.with_name(f".{final.name}.tmp")
