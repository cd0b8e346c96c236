"""Streaming writer for captures.h5: a bounded queue drained by one writer thread.

h5py serialises every call behind one lock, so one writer thread is the useful maximum; the
queue lets the next batch compute while the last one is written, and its bound (`queue_depth`
batches) is what caps memory: the producer blocks when the writer falls behind.

Crash safety: the file is written in HDF5's SWMR mode (single writer, multiple readers) once
its datasets exist, and flushed after every batch; a writer killed at any moment leaves a
file that opens read-only with every row up to the root attribute `completed` intact.
HDF5 then still marks the file as open for writing, so it opens with `swmr=True` (what
`open_readonly()` and `hookrun.open` do), and a resumed run first copies the rows up to
`completed` into a fresh file that replaces it (HDF5 has no public call to clear that mark).
`resume_point()` checks such a file before a run continues it.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import h5py
import numpy as np
import torch
from omegaconf import OmegaConf

from hookrun.errors import HookrunError
from hookrun.profile import StageTimer

__all__ = [
    "CHUNK_BYTES",
    "RESUME_IGNORES",
    "chunk_shape",
    "check_sink_path",
    "open_readonly",
    "resume_point",
    "HDF5Sink",
]

# Config keys that do not change a single number in the file: a resumed run may differ there.
RESUME_IGNORES = (
    "resume",
    "progress",
    "render",
    "render_max",
    "logger",
    "num_workers",
    "dry_run",
    "weights_path",
    "profile",
    "sink.overwrite",
    "sink.queue_depth",
    "sink.path",
)

# Chunks of about 1 MiB along the sample axis: large enough for fast appends, small
# enough that reading a few rows does not pull in much more than asked.
CHUNK_BYTES = 1 << 20

_DONE = object()


def chunk_shape(
    row_shape: tuple[int, ...], itemsize: int, max_rows: int | None = None
) -> tuple[int, ...]:
    """A chunk of ~CHUNK_BYTES: whole rows when a row is smaller, else a slab of one row.

    `max_rows` (the rows the run will write) keeps a small run from allocating a whole
    1 MiB chunk per dataset.
    """
    row_bytes = max(1, math.prod(row_shape) * itemsize)
    if row_bytes <= CHUNK_BYTES:
        rows = max(1, CHUNK_BYTES // row_bytes)
        return (min(rows, max_rows) if max_rows else rows, *row_shape)
    chunk = [1, *row_shape]
    # Split the leading axes of a large row until the chunk fits (e.g. (1, 16, 112, 112)),
    # into equal parts so the last chunk along an axis is not mostly padding.
    for axis in range(1, len(chunk)):
        inner = math.prod(chunk[axis + 1 :]) * itemsize
        fits = max(1, CHUNK_BYTES // max(1, inner))
        parts = math.ceil(chunk[axis] / fits)
        chunk[axis] = math.ceil(chunk[axis] / parts)
        if math.prod(chunk) * itemsize <= CHUNK_BYTES:
            break
    return tuple(chunk)


def check_sink_path(path: Path, overwrite: bool) -> None:
    """Refuse, before any work, a path that exists (unless `overwrite`) or cannot be written."""
    if path.is_dir():
        raise HookrunError(f"sink.path: {path} is a directory; valid: a file path")
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
    probe = parent / f".{path.name}.writable"
    try:
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise HookrunError(f"sink.path: cannot write in {parent} ({err.strerror})") from None


def open_readonly(path: Path) -> h5py.File:
    """Open a captures.h5 for reading, also one whose writer was killed mid-run."""
    try:
        return h5py.File(path, "r")
    except OSError:
        return h5py.File(path, "r", swmr=True)  # still marked open by a killed SWMR writer


def _rewrite_rows(path: Path) -> None:
    """Replace a killed writer's file by a closed copy of its attributes and its rows up to
    `completed`, keeping every dataset's dtype, chunks and compression."""
    fresh = path.with_name(f".{path.name}.resume")
    with open_readonly(path) as src, h5py.File(fresh, "w", libver="latest") as dst:
        rows = int(src.attrs["completed"])
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        datasets: list[str] = []
        src.visititems(lambda n, o: datasets.append(n) if isinstance(o, h5py.Dataset) else None)
        for key in datasets:
            ds = src[key]
            out = dst.create_dataset(
                key,
                shape=(rows, *ds.shape[1:]),
                maxshape=ds.maxshape,
                chunks=ds.chunks,
                dtype=ds.dtype,
                compression=ds.compression,
                compression_opts=ds.compression_opts,
                track_times=False,
            )
            step = max(1, ds.chunks[0])
            for start in range(0, rows, step):
                out[start : start + step] = ds[start : min(rows, start + step)]
    fresh.replace(path)  # atomic: the old file stays whole until the copy is


def _without(config: dict, keys: tuple[str, ...]) -> dict:
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for key in keys:
        head, _, tail = key.partition(".")
        if tail and isinstance(config.get(head), dict):
            config[head].pop(tail, None)
        elif not tail:
            config.pop(head, None)
    return config


def resume_point(path: Path, config_yaml: str) -> int:
    """Rows already complete in the captures.h5 a resumed run continues; HookrunError for a
    missing, foreign, complete or differently configured file."""
    if not path.is_file():
        raise HookrunError(
            f"resume: there is no {path} to resume; run without resume=true, or point "
            "hydra.run.dir (or sink.path) at the interrupted run"
        )
    try:
        with open_readonly(path) as f:
            stored = f.attrs.get("config")
            status, completed = f.attrs.get("status"), int(f.attrs.get("completed", 0))
    except OSError as err:
        raise HookrunError(f"resume: {path} is not a readable HDF5 file ({err})") from None
    if stored is None or status is None:
        raise HookrunError(f"resume: {path} was not written by hookrun (no config/status)")
    if status == "complete":
        raise HookrunError(f"resume: {path} is already complete ({completed} rows); nothing to do")
    before = _without(OmegaConf.to_container(OmegaConf.create(str(stored))), RESUME_IGNORES)
    now = _without(OmegaConf.to_container(OmegaConf.create(config_yaml)), RESUME_IGNORES)
    if before != now:
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        raise HookrunError(
            f"resume: the config differs from the one {path} was written with in "
            f"{', '.join(changed)}; resume with the same config, or start a new run"
        )
    return completed


class HDF5Sink:
    """Append batches of records to one HDF5 file from a background thread.

    Use as a context manager. `write({"captures/fc1/output": array, ...})` queues one batch;
    every batch must carry the same keys with the same row shape. Datasets are created from
    the first batch; `expected_rows` (when known) bounds their chunks. Root attribute
    `completed` counts rows written and flushed; `status` goes `running` → `complete`
    (or `failed` when the run raised). `resume=True` opens an interrupted file instead,
    drops any rows past `completed` and appends from there.
    """

    def __init__(
        self,
        path: Path,
        *,
        dtype: str = "float32",
        compression: str | None = None,
        attrs: Mapping[str, Any] | None = None,
        queue_depth: int = 4,
        overwrite: bool = False,
        expected_rows: int | None = None,
        resume: bool = False,
        timer: StageTimer | None = None,
    ) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.compression = compression
        self.attrs = dict(attrs or {})
        self.overwrite = overwrite
        self.expected_rows = expected_rows
        self.resume = resume
        self.timer = timer or StageTimer(enabled=False)
        self.rows = 0
        self._keys: set[str] = set()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._file: h5py.File | None = None

    def __enter__(self) -> HDF5Sink:
        if self.resume:
            self._reopen()
        else:
            # 'w-' refuses an existing file even if one appeared after check_sink_path.
            self._file = h5py.File(self.path, "w" if self.overwrite else "w-", libver="latest")
            for key, value in self.attrs.items():
                self._file.attrs[key] = value
            # SWMR forbids new attributes later, so every attribute exists from the start.
            self._file.attrs["error"] = ""
            self._file.attrs["status"] = "running"
            self._file.attrs["completed"] = 0
            self._file.flush()
        self._thread = threading.Thread(target=self._drain, name="hookrun-hdf5-writer", daemon=True)
        self._thread.start()
        return self

    def _reopen(self) -> None:
        try:
            self._file = h5py.File(self.path, "r+", libver="latest")
        except OSError:  # the writer was killed: HDF5 still marks the file open for writing
            _rewrite_rows(self.path)
            self._file = h5py.File(self.path, "r+", libver="latest")
        self.rows = int(self._file.attrs["completed"])
        self._file.visititems(
            lambda name, obj: self._keys.add(name) if isinstance(obj, h5py.Dataset) else None
        )
        for key in self._keys:  # rows past `completed` may be half written: drop them
            self._file[key].resize(self.rows, axis=0)
        self._file.attrs["status"] = "running"
        self._file.attrs["error"] = ""
        self._file.flush()
        if self._keys:
            self._file.swmr_mode = True

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
            self._queue.put(_DONE)
            self._thread.join()
        assert self._file is not None
        ok = exc is None and self._error is None
        self._file.attrs["status"] = "complete" if ok else "failed"
        if not ok:
            err = exc or self._error
            self._file.attrs["error"] = f"{type(err).__name__}: {err}"
        self._file.close()
        if exc is None:
            self._raise_writer_error()

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing {self.path} failed: {self._error}") from self._error

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
        arrays = {
            k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in batch.items()
        }
        if not self._keys:
            for key, array in arrays.items():
                self._create(key, array)
            self._file.swmr_mode = True  # all datasets exist: from here a kill loses nothing
        if set(arrays) != self._keys:
            raise RuntimeError(
                f"batch keys changed: missing {sorted(self._keys - set(arrays))}, "
                f"new {sorted(set(arrays) - self._keys)}"
            )
        n = {len(a) for a in arrays.values()}
        if len(n) != 1:
            raise RuntimeError(f"records of one batch differ in length: {n}")
        count = n.pop()
        for key, array in arrays.items():
            ds = self._file[key]
            ds.resize(self.rows + count, axis=0)
            ds[self.rows : self.rows + count] = array
        self.rows += count
        self._file.attrs["completed"] = self.rows
        self._file.flush()

    def _create(self, key: str, array: np.ndarray) -> None:
        assert self._file is not None
        dtype = self.dtype if np.issubdtype(array.dtype, np.floating) else array.dtype
        row = tuple(array.shape[1:])
        self._keys.add(key)
        self._file.create_dataset(
            key,
            shape=(0, *row),
            maxshape=(None, *row),
            chunks=chunk_shape(row, dtype.itemsize, self.expected_rows),
            dtype=dtype,
            compression=self.compression,
            track_times=False,  # same numbers → same bytes, whenever the run happened
        )
