"""A corpus's token ids on disk: appended as int32 to an unlinked temporary file (Python's
temporary folder: TMPDIR, else /tmp) or to a named one (the run's token cache,
data/token_cache.py), read back by offset with os.pread, so that neither the ids nor a file
position are shared state: the loader's workers read it as the main process does. Unlinked,
the file is gone when the process ends, killed or not."""

from __future__ import annotations

import os
import tempfile
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from pathlib import Path
from typing import Any

import numpy as np

from hookrun.errors import HookrunError

__all__ = ["TokenFile"]


class TokenFile:
    """Token ids appended as int32 to an unlinked temporary file, or to the new file `path`,
    read back by offset (pread: workers forked by the loader share it safely)."""

    def __init__(self, path: Path | None = None) -> None:
        try:
            # Lives as long as the rows (no with-block): unlinked, it goes with the process.
            if path is None:
                self._file = tempfile.TemporaryFile(prefix="hookrun-tokens-")  # noqa: SIM115
            else:
                self._file = open(path, "x+b")  # noqa: SIM115
        except OSError as err:
            raise _no_room(err, path) from None
        self.size, self._path = 0, path

    @classmethod
    def reopened(cls, path: Path) -> TokenFile:
        """The ids of a file written before (read only)."""
        store = cls.__new__(cls)
        store._file = open(path, "rb")  # noqa: SIM115
        store.size, store._path = os.fstat(store._file.fileno()).st_size // 4, path
        return store

    def append(self, ids: np.ndarray) -> None:
        try:
            self._file.write(np.asarray(ids, dtype=np.int32).tobytes())
        except OSError as err:
            raise _no_room(err, self._path) from None
        self.size += len(ids)

    def done(self) -> None:
        try:
            self._file.flush()
        except OSError as err:
            raise _no_room(err, self._path) from None

    def read(self, start: int, count: int) -> np.ndarray:
        parts, want, at = [], 4 * count, 4 * start
        while want:  # pread may return less than asked (Linux caps one call near 2 GiB)
            part = os.pread(self._file.fileno(), want, at)
            if not part:
                raise EOFError(f"token file: {want} bytes missing at {at}")
            parts.append(part)
            want, at = want - len(part), at + len(part)
        return np.frombuffer(b"".join(parts), dtype=np.int32).astype(np.int64)

    def __reduce__(self) -> tuple:
        if get_spawning_popen() is not None:
            # A loader worker being started by spawn or forkserver: it gets a duplicate of
            # the descriptor (the file has no name to reopen); forked workers inherit it.
            return _reopened, (reduction.DupFd(self._file.fileno()), self.size)
        # Any other pickle (a file, a copy): the ids themselves, a self-contained copy.
        return _restored, (self.read(0, self.size).astype(np.int32).tobytes(), self.size)


def _reopened(duplicate: Any, size: int) -> TokenFile:
    store = TokenFile.__new__(TokenFile)
    store._file = os.fdopen(duplicate.detach(), "rb")
    store.size, store._path = size, None
    return store


def _restored(raw: bytes, size: int) -> TokenFile:
    store = TokenFile()
    store.append(np.frombuffer(raw, dtype=np.int32))
    store.done()
    assert store.size == size
    return store


def _no_room(err: OSError, path: Path | None = None) -> HookrunError:
    where = tempfile.gettempdir() if path is None else path.parent
    room = "a TMPDIR" if path is None else "a run folder"
    return HookrunError(
        f"dataset: cannot write the corpus's token ids to {where} "
        f"({err.strerror or err}); valid: {room} with room for 4 bytes a token"
    )
