"""Whole-run datasets: what a stage computes once every row of a run is in its file (the
circuits' faithfulness, the induction score per head, the steering vectors), kept inside the
file's promise that `complete` means everything.

Each is made with the file (io/appender.py at its first batch, io/stored.py at the torchrun
join), before SWMR starts, holding its fill value and marked pending (layout.WRITTEN = 0).
Once every row is in, the file is opened again directly in SWMR mode (`finishing`): a kill
at any moment leaves a file every reader opens with all its rows intact, which resume=true
continues. Each stage's values are written and flushed, then its datasets are marked written
and flushed again, so a mark never runs ahead of its values; only when no dataset is pending
is the file marked complete. A resume finds the pending ones and computes those alone.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.errors import Interrupted, RunFault
from hookrun.io import storage
from hookrun.io.dimensions import AxisFacts, attach, axis_names
from hookrun.io.layout import (
    is_pending,
    mark_pending,
    mark_status,
    mark_written,
    open_readonly,
    pending,
    set_attrs,
)
from hookrun.io.storage import chunk_shape

__all__ = [
    "WholeRun",
    "make_pending",
    "open_swmr_writer",
    "finishing",
    "write_whole_run",
    "pending_of",
    "name_whole_run",
    "written_values",
    "make_constants",
]


@dataclass(frozen=True)
class WholeRun:
    """One dataset a stage writes once for the whole run: its shape (no sample axis), its
    dtype and its attributes, all known before any work."""

    shape: tuple[int, ...]
    dtype: str = "float64"
    attrs: Mapping[str, Any] = field(default_factory=dict)


def make_pending(f: h5py.File, made: Mapping[str, WholeRun], checksum: bool) -> None:
    """Each whole-run dataset of `made` that `f` lacks, made pending (before SWMR: they are
    new objects), with its attributes; chunked, so a cut file and a torn write are seen."""
    for key, spec in made.items():
        if key in f:
            continue
        dtype = np.dtype(spec.dtype)
        shape = tuple(spec.shape)
        ds = f.create_dataset(
            key,
            shape=shape,
            dtype=dtype,
            chunks=chunk_shape(shape[1:], dtype.itemsize, max(1, shape[0])) if shape else None,
            fillvalue=np.nan if dtype.kind == "f" else 0,
            fletcher32=checksum and bool(shape),
            track_times=False,
        )
        set_attrs(ds, spec.attrs)
        mark_pending(ds)


def make_constants(f: h5py.File, constants: Mapping[str, np.ndarray], checksum: bool) -> None:
    """Whole-run datasets known before any work (the vocabulary's texts), written whole into
    a new file with its first batch (before SWMR); compressed: they are written once."""
    for key, data in constants.items():
        if key in f:
            continue
        array = np.asarray(data)
        f.create_dataset(
            key,
            data=array,
            chunks=chunk_shape(array.shape[1:], array.dtype.itemsize, max(1, len(array))),
            compression="gzip",
            fletcher32=checksum,
            track_times=False,
        )


def name_whole_run(f: h5py.File, keys: list[str], checksum: bool) -> None:
    """Name the axes of whole-run datasets made after the file's other datasets were named
    (the torchrun join's, an older file's), as a new file names them (io/dimensions.py)."""
    attach(f, {key: axis_names(key, f[key], AxisFacts()) for key in keys}, checksum)


def open_swmr_writer(path: Path) -> h5py.File:
    """`path` opened for writing in SWMR mode from its first moment (no window in which a
    kill leaves the file marked open by a writer without SWMR, which no reader can open)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_fclose_degree(h5py.h5f.CLOSE_STRONG)  # no handle outlives the file's close
    flags = h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE
    return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=fapl))


def write_whole_run(f: h5py.File, values: Mapping[str, Any]) -> None:
    """Write one stage's whole-run values into their pending datasets: every value first,
    flushed, then every mark (a kill between them leaves them pending: computed again)."""
    arrays = {key: np.asarray(value) for key, value in values.items()}
    for key, array in arrays.items():
        if array.shape != f[key].shape:
            raise ValueError(f"/{key}: values of shape {array.shape}, the dataset {f[key].shape}")
    datasets = [f[key] for key in arrays]
    try:
        # Room first (io/storage.py): on a full disk the request fails, HDF5 untouched.
        rows = max((len(d) for d in datasets), default=1)
        storage.reserve(f, storage.batch_need(datasets, 0, rows))
        for ds, array in zip(datasets, arrays.values(), strict=True):
            ds[...] = array.astype(ds.dtype, copy=False)
        f.flush()
        for ds in datasets:
            mark_written(ds)
        f.flush()
    except (OSError, RuntimeError) as err:
        code = storage.disk_errno(err)
        if code is None:
            raise
        raise _DiskFault(code) from err


class _DiskFault(Exception):
    """Writing whole-run values failed for the disk's sake (its errno)."""

    def __init__(self, code: int) -> None:
        super().__init__(os.strerror(code))
        self.code = code


@contextmanager
def finishing(path: Path, made: Mapping[str, WholeRun], checksum: bool) -> Iterator[h5py.File]:
    """The file at `path`, every row in it, open in SWMR mode to write its whole-run
    datasets (`made`: those the run writes). On leaving it is marked complete once none is
    pending; on an error, marked interrupted (a signal) or failed, with the error; a write
    HDF5 failed leaves the file as it was after its last flush (the handle is abandoned:
    resume=true continues it)."""
    with h5py.File(path, "r") as f:
        absent = {key: spec for key, spec in made.items() if key not in f}
    if absent:  # a file begun before its datasets were made with it (an older hookrun)
        with h5py.File(path, "r+", libver="latest") as f:
            make_pending(f, absent, checksum)
            name_whole_run(f, list(absent), checksum)
    f = open_swmr_writer(path)
    try:
        yield f
    except _DiskFault as err:  # the file as after its last flush; HDF5 must not write again
        storage.abandon(f)
        room = err.code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        raise RunFault(
            f"writing {path} failed: [Errno {err.code}] {err}; every row is kept, and the "
            f"whole-run results written: {'make room' if room else 'check the disk'}, then "
            "run again with resume=true (it computes those still unwritten)"
        ) from err.__cause__
    except BaseException as err:
        status = "interrupted" if isinstance(err, Interrupted) else "failed"
        mark_status(f, status, f"{type(err).__name__}: {err}")
        f.close()
        raise
    if not pending(f):
        mark_status(f, "complete")
    f.close()
    storage.trim(path)


def written_values(path: Path, keys: list[str]) -> dict[str, np.ndarray]:
    """The whole-run values among `keys` an earlier file at `path` holds written (a torchrun
    join a kill stopped during its whole-run work: the resume's new join keeps them); {} for
    a file that cannot be read."""
    try:
        with open_readonly(path) as f:
            return {k: f[k][()] for k in keys if k in f and not is_pending(f[k])}
    except (OSError, KeyError, RuntimeError, ValueError):
        return {}


def pending_of(f: h5py.File, keys: list[str]) -> bool:
    """Whether any of `keys` is absent from `f` or still waits for its values."""
    return any(key not in f or is_pending(f[key]) for key in keys)
