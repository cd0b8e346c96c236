"""Files made from stored captures files, and reading them in part: rows of a stored record
(the `patch` action reads another run's file), a killed writer's rows copied into a fresh
file (resume), and the torchrun join of shard files into one file of virtual datasets.
Paths and attributes come from io/layout.py."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io import storage
from hookrun.io.appender import CapturesFile, FileOptions, Summaries
from hookrun.io.dimensions import attach, read_names
from hookrun.io.encoding import read_floats
from hookrun.io.layout import (
    SPARSE_COUNTS,
    FileState,
    Provenance,
    copy_attrs,
    copy_group_attrs,
    dataset_names,
    drop_scale_attrs,
    is_pending,
    is_whole_run,
    mark_complete,
    mark_completed,
    mark_status,
    mark_written,
    open_readonly,
    pending,
    read_state,
    rows_for,
    rows_note,
    sparse_part,
    write_attrs,
    write_header,
)
from hookrun.io.storage import torn_tail_rows
from hookrun.io.whole_run import WholeRun, make_pending, name_whole_run

__all__ = ["stored_record", "record_rows", "read_rows", "reopen", "rewrite_rows", "join_shards"]


def stored_record(file: Path, record: str) -> tuple[FileState, tuple[int, ...] | None, list]:
    """A stored file's state, the per-row shape of its dataset `record` (None: absent) and
    every dataset it holds — what a run that reads it (`patch`) checks before starting."""
    with open_readonly(file) as f:
        ds = f.get(record)
        shape = tuple(ds.shape[1:]) if isinstance(ds, h5py.Dataset) else None
        return read_state(f), shape, dataset_names(f)


def record_rows(file: Path, record: str) -> str:
    """How the rows of a stored dataset map to samples: '' for one row per sample, else
    the layout's note (one row per batch, rows folded per sample)."""
    with open_readonly(file) as f:
        return rows_note(f[record])


def read_rows(file: Path, record: str, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (any order, repeats allowed) of one dataset of a stored file, as numbers
    (a bfloat16 record decoded: its bits are no values)."""
    unique, inverse = np.unique(rows, return_inverse=True)  # HDF5 reads increasing rows
    with open_readonly(file) as f:
        return read_floats(f[record], unique)[inverse]


def reopen(path: Path, options: FileOptions, header: Provenance | None = None) -> CapturesFile:
    """Continue an interrupted file from `completed`; one whose writer died before its first
    row is started over with `header` (there is nothing in it to keep)."""
    try:
        h5py.File(path, "r+", libver="latest").close()
    except OSError:  # the writer was killed: HDF5 still marks the file open for writing
        # Only the open is tried here: a fault later in the reopen (a flush on a failing
        # disk) is that fault, not a killed writer, and must not rewrite the file.
        try:
            rewrite_rows(path)
        except OSError as err:
            if header is None or not storage.never_written(err):
                raise
            return CapturesFile.create(path, header, options, overwrite=True)
    return CapturesFile.reopen(path, options)


def rewrite_rows(path: Path) -> None:
    """Replace a killed writer's file by a closed copy of its attributes and its rows up to
    `completed` (one per batch where a dataset holds one per batch), keeping every
    dataset's dtype, chunks, compression, attributes and dimension names."""
    fresh = path.with_name(f".{path.name}.resume")
    with open_readonly(path) as src, h5py.File(fresh, "w", libver="latest") as dst:
        completed = read_state(src).completed
        copy_attrs(src, dst)
        for key in dataset_names(src):
            ds = src[key]
            rows = rows_for(ds, completed)
            out = dst.create_dataset(
                key,
                shape=(rows, *ds.shape[1:]),
                maxshape=ds.maxshape,
                chunks=ds.chunks,
                dtype=ds.dtype,
                compression=ds.compression,
                compression_opts=ds.compression_opts,
                fletcher32=ds.fletcher32,
                fillvalue=ds.fillvalue,
                track_times=False,
            )
            copy_attrs(ds, out)
            if is_pending(ds):  # a whole-run dataset not written yet: a torn write is no data
                continue
            step = max(1, ds.chunks[0])
            entries = sparse_part(ds) not in (None, SPARSE_COUNTS)
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                try:
                    out[start:stop] = ds[start:stop]
                except OSError:
                    # The last chunk of a sparse record's entries, torn by the kill (its
                    # counted entries intact: storage.torn_tail_rows); any other: damage.
                    torn = torn_tail_rows(ds, start, stop) if entries and stop == rows else None
                    if torn is None:
                        raise
                    out[start:stop] = torn
        attach(dst, read_names(src), _checksummed(src))
        copy_group_attrs(src, dst)
    fresh.replace(path)  # atomic: the old file stays whole until the copy is


def join_shards(
    path: Path,
    shards: list[Path],
    samples: int,
    header: Provenance | Mapping[str, Any],
    replace: bool = False,
    summaries: Summaries | None = None,
    finishes: Mapping[str, WholeRun] | None = None,
    attrs: Mapping[str, Mapping[str, Any]] | None = None,
    written: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Write `path` as virtual datasets over complete shard files, in the given order; an
    existing `path` only with `replace`; `summaries` writes what the file says of all its
    rows, over every shard's; `finishes`: the whole-run datasets made pending (the file is
    then marked complete once they are written: io/whole_run.py), `attrs` those of their
    datasets and groups, which no shard holds (path → {name: value}); `written`: values of
    some of them already computed (an earlier join's: a resume computes only the others).
    The join is made under
    another name and takes its own when whole: a kill while joining leaves no half-made
    captures.h5. Raises ValueError naming an incomplete shard."""
    opened = [h5py.File(s, "r") for s in shards]
    part = path.with_name(f".{path.stem}.join{path.suffix}")
    try:
        for shard, f in zip(shards, opened, strict=True):
            if read_state(f).status != "complete":
                raise ValueError(f"the shard {shard} is not complete")
        if path.exists() and not replace:
            raise FileExistsError(errno.EEXIST, "file exists", str(path))
        with h5py.File(part, "w", libver="latest") as out:
            write_header(out, header)
            for key in dataset_names(opened[0]):
                first = opened[0][key]
                if is_whole_run(first):  # the same in every shard (the vocabulary): copied
                    # once (a virtual dataset takes no variable-length strings)
                    opened[0].copy(first, out, name=key)
                    drop_scale_attrs(out[key])  # they point into the shard
                    continue
                # Shards hold whole batches in order, so a record stored once per batch
                # joins in global batch order too.
                # A sparse record's entries: each shard's, of the rows it holds, in order.
                entries = sparse_part(first) not in (None, SPARSE_COUNTS)
                total = (
                    sum(f[key].shape[0] for f in opened) if entries else rows_for(first, samples)
                )
                if entries and not total:  # no entry in any shard: nothing to point at
                    made = out.create_dataset(
                        key, shape=(0,), maxshape=(None,), chunks=first.chunks, dtype=first.dtype
                    )
                    copy_attrs(first, made)
                    continue
                virtual = h5py.VirtualLayout(shape=(total, *first.shape[1:]), dtype=first.dtype)
                offset = 0
                for shard, f in zip(shards, opened, strict=True):
                    rows = f[key].shape[0]
                    if not rows:  # a shard whose rows hold no entry
                        continue
                    # A bare file name: HDF5 finds the shard next to captures.h5 wherever
                    # the run directory is moved.
                    virtual[offset : offset + rows] = h5py.VirtualSource(
                        shard.name, key, shape=f[key].shape
                    )
                    offset += rows
                if offset != total:
                    raise ValueError(f"the shards hold {offset} rows of /{key}, not {total}")
                copy_attrs(first, out.create_virtual_dataset(key, virtual))
            checksum = _checksummed(opened[0])
            attach(out, read_names(opened[0]), checksum)
            make_pending(out, finishes or {}, checksum)
            name_whole_run(out, list(finishes or {}), checksum)
            for key, value in (written or {}).items():
                out[key][...] = value
                mark_written(out[key])
            copy_group_attrs(opened[0], out)
            write_attrs(out, attrs or {})
            if summaries is not None:
                summaries(out, samples, opened)  # over every shard's rows
            if pending(out):  # every row is in: complete once the whole-run datasets are
                mark_completed(out, samples)
                mark_status(out, "running")
            else:
                mark_complete(out, samples)
        os.replace(part, path)  # the same folder: whole or not at all
    finally:
        for f in opened:
            f.close()
        part.unlink(missing_ok=True)


def _checksummed(f: h5py.File) -> bool:
    """Whether a file's datasets carry fletcher32 (its copy's new scales then do too)."""
    return any(f[key].fletcher32 for key in dataset_names(f))
