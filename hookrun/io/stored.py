"""Reading stored captures files whole or in part: rows of a stored record (the `patch`
action reads another run's file), and the torchrun join of shard files into one file of
virtual datasets. Paths and attributes come from io/layout.py."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io.layout import (
    FileState,
    Provenance,
    copy_attrs,
    dataset_names,
    mark_complete,
    open_readonly,
    read_state,
    rows_for,
    write_header,
)

__all__ = ["stored_record", "read_rows", "join_shards"]


def stored_record(file: Path, record: str) -> tuple[FileState, tuple[int, ...] | None, list]:
    """A stored file's state, the per-row shape of its dataset `record` (None: absent) and
    every dataset it holds — what a run that reads it (`patch`) checks before starting."""
    with open_readonly(file) as f:
        ds = f.get(record)
        shape = tuple(ds.shape[1:]) if isinstance(ds, h5py.Dataset) else None
        return read_state(f), shape, dataset_names(f)


def read_rows(file: Path, record: str, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (any order, repeats allowed) of one dataset of a stored file."""
    unique, inverse = np.unique(rows, return_inverse=True)  # HDF5 reads increasing rows
    with open_readonly(file) as f:
        return f[record][unique][inverse]


def join_shards(
    path: Path,
    shards: list[Path],
    samples: int,
    header: Provenance | Mapping[str, Any],
    replace: bool = False,
) -> None:
    """Write `path` as virtual datasets over complete shard files, in the given order; an
    existing `path` only with `replace`. Raises ValueError naming an incomplete shard."""
    opened = [h5py.File(s, "r") for s in shards]
    try:
        for shard, f in zip(shards, opened, strict=True):
            if read_state(f).status != "complete":
                raise ValueError(f"the shard {shard} is not complete")
        with h5py.File(path, "w" if replace else "w-", libver="latest") as out:
            write_header(out, header)
            for key in dataset_names(opened[0]):
                first = opened[0][key]
                # Shards hold whole batches in order, so a record stored once per batch
                # joins in global batch order too.
                total = rows_for(first, samples)
                virtual = h5py.VirtualLayout(shape=(total, *first.shape[1:]), dtype=first.dtype)
                offset = 0
                for shard, f in zip(shards, opened, strict=True):
                    rows = f[key].shape[0]
                    # A bare file name: HDF5 finds the shard next to captures.h5 wherever
                    # the run directory is moved.
                    virtual[offset : offset + rows] = h5py.VirtualSource(
                        shard.name, key, shape=f[key].shape
                    )
                    offset += rows
                if offset != total:
                    raise ValueError(f"the shards hold {offset} rows of /{key}, not {total}")
                copy_attrs(first, out.create_virtual_dataset(key, virtual))
            mark_complete(out, samples)
    finally:
        for f in opened:
            f.close()
