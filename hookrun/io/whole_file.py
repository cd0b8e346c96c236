"""A file replaced whole: written under a temporary name beside it, flushed to the disk and
renamed over the old one, the folder's entry synced too. A kill at any moment leaves the old
file or the new one, never a torn one (a rename within one folder is atomic)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replaced_whole"]


@contextlib.contextmanager
def replaced_whole(path: Path) -> Iterator[Path]:
    """The temporary path to write `path`'s new contents to; on a clean exit it becomes
    `path`, on any exception it is removed and `path` stays as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    temp = Path(name)
    try:
        yield temp
        with open(temp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """The rename itself on disk (a power cut after it keeps the new name)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
