"""One writer per captures.h5: an OS lock held for the whole run.

The lock is `flock` on a side file next to the captures file (`.captures.h5.lock`): the kernel
releases it when the process ends however it ends (kill -9 included), which a pid file cannot
promise. It is not taken on the captures file itself because HDF5 takes its own `flock` there
while the file is open. The side file records the holder (pid, host) so a refused run can
say who holds it; the file stays after the run (removing it would let a third process lock a
fresh inode while a second one still waits on the old one).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
from pathlib import Path

from hookrun.errors import HookrunError

__all__ = ["WriterLock", "lock_path"]


def lock_path(path: Path) -> Path:
    """`.../captures.h5` → `.../.captures.h5.lock` (a name past the file system's 255 bytes
    is shortened to a hash of it, so any file name a user may choose can be locked)."""
    name = f".{path.name}.lock"
    if len(name.encode()) > 255:
        name = f".{hashlib.sha256(path.name.encode()).hexdigest()}.lock"
    return path.with_name(name)


class WriterLock:
    """The exclusive right to write `path` for this process; HookrunError naming the holder
    when another process has it. `release()` (or the process ending) gives it back."""

    def __init__(self, path: Path) -> None:
        self.path = lock_path(path)
        self._fd: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise HookrunError(
                f"sink.path: cannot create folder {self.path.parent} ({err.strerror})"
            ) from None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise HookrunError(
                f"sink.path: cannot create the lock file {self.path} ({err.strerror}); "
                "valid: a folder this user can write"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise HookrunError(
                f"sink.path: {path} is being written by another run ({holder}); wait for it "
                "to end, or choose another sink.path / hydra.run.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor drops the flock
