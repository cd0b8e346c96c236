"""Streaming writer for captures.h5: a bounded queue drained by one writer thread.

h5py serialises every call behind one lock, so one writer thread is the useful maximum; the
queue lets the next batch compute while the last one is written, and its bound (`queue_depth`
batches) is what caps memory: the producer blocks when the writer falls behind. What is
written where is io/layout.py's business; this module only moves batches to it.
"""

from __future__ import annotations

import errno
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from hookrun.errors import HookrunError, Interrupted, RunFault
from hookrun.io.appender import CapturesFile, FileOptions, Summaries
from hookrun.io.dimensions import AxisFacts
from hookrun.io.encoding import host_array
from hookrun.io.layout import Provenance
from hookrun.io.sparse import SparseRows, SparseSpec, host_rows
from hookrun.io.storage import disk_errno
from hookrun.io.stored import reopen
from hookrun.io.whole_run import WholeRun
from hookrun.timing import StageTimer

__all__ = ["SinkOptions", "HDF5Sink", "check_sink_path"]

_DONE = object()


@dataclass(frozen=True)
class SinkOptions:
    """How the sink stores (dtype, compression, expected rows) and buffers (queue depth)."""

    dtype: str = "float32"
    compression: str | None = None
    queue_depth: int = 4
    overwrite: bool = False
    expected_rows: int | None = None
    checksum: bool = True  # fletcher32 per chunk (off only to measure what it costs)
    # Records not stored one row per sample: path → rows per sample (0: one row per batch).
    folds: Mapping[str, int] = field(default_factory=dict)
    batch_size: int = 1
    axes: AxisFacts = field(default_factory=AxisFacts)  # for the dimension names
    # Attributes of new datasets and groups (path → {name: value}): evaluation's fractions.
    attrs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Captures stored in another float than `dtype` (a hook's args.dtype): path → dtype.
    dtypes: Mapping[str, str] = field(default_factory=dict)
    # What the file says of all its rows before it is marked complete (io/appender.py).
    summaries: Summaries | None = None
    # The stages' whole-run datasets, made with the file (io/whole_run.py).
    finishes: Mapping[str, WholeRun] = field(default_factory=dict)
    # Whole-run datasets known before any work (path → values: the vocabulary's texts).
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)
    # Sparse records, whose batches are SparseRows: path → (dense shape, dims) (io/appender.py).
    sparse: Mapping[str, SparseSpec | tuple] = field(default_factory=dict)

    @property
    def file_options(self) -> FileOptions:
        return FileOptions(
            dtype=self.dtype,
            compression=self.compression,
            expected_rows=self.expected_rows,
            checksum=self.checksum,
            folds=dict(self.folds),
            batch_size=self.batch_size,
            axes=self.axes,
            attrs=dict(self.attrs),
            dtypes=dict(self.dtypes),
            summaries=self.summaries,
            finishes=dict(self.finishes),
            constants=dict(self.constants),
            sparse=dict(self.sparse),
        )


def check_sink_path(path: Path, overwrite: bool) -> None:
    """Refuse, before any work, a path that exists (unless `overwrite`) or cannot be written."""
    if path.is_dir():
        raise HookrunError(f"sink.path: {path} is a directory; valid: a file path")
    if path.is_symlink() and not path.exists():
        raise HookrunError(
            f"sink.path: {path} is a symbolic link to {path.readlink()}, which does not exist; "
            "valid: a plain file path"
        )
    if path.exists() and not path.is_file():
        raise HookrunError(
            f"sink.path: {path} is not a regular file (a device, a pipe); valid: a plain file path"
        )
    if path.exists() and not overwrite:
        raise HookrunError(
            f"sink.path: {path} already exists and is never overwritten silently; choose "
            "another sink.path, or set sink.overwrite=true"
        )
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HookrunError(f"sink.path: cannot create folder {parent} ({err.strerror})") from None
    try:  # a name of its own: `.{path.name}…` could pass the file system's 255 bytes
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".hookrun-", suffix=".writable")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise HookrunError(f"sink.path: cannot write in {parent} ({err.strerror})") from None


class HDF5Sink:
    """Append batches of records to one captures.h5 from a background thread.

    Use as a context manager. `write({path: array, ...})` queues one batch (paths from
    io/layout.py); every batch must carry the same keys with the same row shape. A key of
    `options.sparse` takes io/sparse.py's SparseRows (torch or numpy: `sparsify(tensor)`). With
    `header` the file is created (status `running` → `complete`, or `failed` when the run
    raised); with `resume=True` an interrupted file is continued from `completed` instead.
    """

    def __init__(
        self,
        path: Path,
        options: SinkOptions | None = None,
        *,
        header: Provenance | None = None,
        resume: bool = False,
        timer: StageTimer | None = None,
    ) -> None:
        self.path = Path(path)
        self.options = options or SinkOptions()
        self.header = header
        self.resume = resume
        self.timer = timer or StageTimer(enabled=False)
        self._queue: queue.Queue = queue.Queue(maxsize=self.options.queue_depth)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._file: CapturesFile | None = None

    @property
    def rows(self) -> int:
        return self._file.rows if self._file is not None else 0

    def __enter__(self) -> HDF5Sink:
        options = self.options.file_options
        if self.resume and self.path.exists():  # a requeued job may not have one yet
            self._file = reopen(self.path, options, self.header)
        else:
            header = self.header or {}  # files written outside a run (tests, benchmarks)
            self._file = CapturesFile.create(self.path, header, options, self.options.overwrite)
        self._thread = threading.Thread(target=self._drain, name="hookrun-hdf5-writer", daemon=True)
        self._thread.start()
        return self

    def write(
        self,
        records: Mapping[str, torch.Tensor | np.ndarray],
        ready: list | None = None,
        on_written: Callable[[list], None] | None = None,
    ) -> None:
        """Queue one batch; blocks while `queue_depth` batches are already waiting.

        `ready`: events (CUDA copies) the writer waits for before reading the batch;
        `on_written`: called by the writer with the batch's tensors once they are on disk.
        """
        self._raise_writer_error()
        with self.timer.stage("queue wait"):
            self._queue.put((dict(records), list(ready or []), on_written))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._thread is not None:
            self._queue.put(_DONE)  # the batches already queued are written first
            self._thread.join()
        assert self._file is not None
        error = exc or self._error
        try:
            self._file.close(error, interrupted=isinstance(error, Interrupted))
        except (OSError, RuntimeError) as err:
            self._error = self._error or err
        if exc is None:
            self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        err = self._error
        if err is None:
            return
        code = disk_errno(err)
        if code or isinstance(err, OSError):  # the disk's fault, not the data's: resumable
            reason = f"[Errno {code}] {os.strerror(code)}" if code else str(err)
            rows = self._file.rows if self._file is not None else 0
            # Room helps a full disk or a file-size limit; anything else is the disk's health.
            fix = (
                "make room"
                if code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
                else "check the disk"
            )
            raise RunFault(
                f"writing {self.path} failed: {reason.splitlines()[0]}; its first {rows} "
                f"rows are kept: {fix}, then run again with resume=true"
            ) from err
        raise RuntimeError(f"writing {self.path} failed: {err}") from err

    def _drain(self) -> None:
        while (item := self._queue.get()) is not _DONE:
            if self._error is not None:
                continue  # keep draining so the producer never blocks forever
            batch, ready, on_written = item
            try:
                for event in ready:
                    event.synchronize()  # the device → host copy has landed
                with self.timer.stage("write"):
                    self._append(batch)
                if on_written is not None:
                    on_written(list(batch.values()))
            except BaseException as err:  # handed to the producer thread, re-raised there
                self._error = err

    def _append(self, batch: dict[str, Any]) -> None:
        assert self._file is not None
        stored = self._file.options.dtype_of
        self._file.append(
            {
                k: (host_rows if isinstance(v, SparseRows) else host_array)(
                    v, stored(k) == "bfloat16"
                )
                for k, v in batch.items()
            }
        )
