"""Appending rows to a captures.h5, batch by batch, so that a fault at any moment loses
nothing already counted in `completed`.

A new file takes its name when its first batch comes, made beside it under another name
(header, datasets, SWMR on) and renamed: the path never names a file HDF5 holds open
without SWMR, which no reader can open after a kill. A run killed before its first batch
leaves no file (resume=true starts it); one stopped by a signal or an error before it
leaves a closed file with its header and status. From the first batch: a flush every batch,
`completed` advanced only after the data is flushed; a killed writer's file opens read-only
(`open_readonly`) with every row up to `completed` intact, and io/stored.py's
`rewrite_rows` copies them into a fresh file (HDF5 cannot clear a dead writer's mark). Every
path and attribute name comes from io/layout.py.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io import storage
from hookrun.io.dimensions import AxisFacts, name_dimensions
from hookrun.io.layout import (
    SAMPLE,
    SAMPLES_INDEX,
    SPARSE_PARTS,
    Provenance,
    dataset_names,
    is_whole_run,
    mark_bfloat16,
    mark_completed,
    mark_rows,
    mark_sparse,
    mark_status,
    per_batch,
    read_state,
    rows_for,
    sparse_groups,
    sparse_spec,
    write_attrs,
    write_header,
)
from hookrun.io.sparse import SparseRows, SparseSpec, check_rows
from hookrun.io.storage import chunk_shape
from hookrun.io.whole_run import (
    WholeRun,
    make_constants,
    make_pending,
    open_swmr_writer,
    pending_of,
)

__all__ = ["FileOptions", "CapturesFile", "Summaries"]

# Entries per chunk of a sparse record's values and latent (1-D, appended at any length):
# 256 KiB of float32, so an append touches one or two chunks beyond its own.
ENTRY_CHUNK = 1 << 16

# What a file says of all its rows (file, rows, the shard files a join reads, or None),
# written before it is marked complete.
Summaries = Callable[[h5py.File, int, "list[h5py.File] | None"], None]


@dataclass(frozen=True)
class FileOptions:
    """How new datasets are stored: float dtype, compression, the rows expected (which
    keeps a small run from allocating a whole 1 MiB chunk per dataset), and HDF5's
    fletcher32 checksum on every chunk (a damaged chunk then fails loudly on read)."""

    dtype: str = "float32"
    compression: str | None = None
    expected_rows: int | None = None
    checksum: bool = True
    # Records not stored one row per sample: path → rows per sample (0: one row per batch).
    folds: Mapping[str, int] = dataclasses.field(default_factory=dict)
    batch_size: int = 1
    # What the run knows of its tensors' axes, for their dimension names (io/layout.py).
    axes: AxisFacts = dataclasses.field(default_factory=AxisFacts)
    # Attributes of new datasets and groups (path → {name: value}), set as they are created.
    attrs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    # Captures stored in another float than `dtype` (a hook's args.dtype): path → dtype.
    dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # What the file says of all its rows, written before it is marked complete (the
    # stages': hookrun/stage.py `complete`): (file, rows, shards or None).
    summaries: Summaries | None = None
    # The stages' whole-run datasets (io/whole_run.py), made with the file and written once
    # every row is in: until then it is not marked complete (path → shape, dtype, attrs).
    finishes: Mapping[str, WholeRun] = dataclasses.field(default_factory=dict)
    # Whole-run datasets known before any work (path → values), written with the first batch.
    constants: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # Sparse records (io/sparse.py: the batch's value is a SparseRows): group path →
    # SparseSpec(dense per-sample shape, axis names with the sample axis first), e.g.
    # {"sae/h.1/output/latents": ((T, 16384), ("sample", "token", "latent"))}. Needed only
    # to make the file: it marks the group, so a reopened file knows without options.
    sparse: Mapping[str, SparseSpec | tuple] = dataclasses.field(default_factory=dict)

    def dtype_of(self, key: str) -> str:
        """The float the dataset at `key` is stored in."""
        return self.dtypes.get(key, self.dtype)


def _give_name(part: Path, path: Path, overwrite: bool) -> None:
    """`part` renamed to `path`; an existing `path` is refused unless `overwrite` (a hard link
    refuses it atomically; on a file system without links — FUSE, FAT — the run's writer
    lock and the check just before stand in)."""
    if overwrite:
        os.replace(part, path)
        return
    try:
        os.link(part, path)
    except FileExistsError:
        raise
    except OSError:
        if path.exists():
            raise FileExistsError(errno.EEXIST, "file exists", str(path)) from None
        os.rename(part, path)
    else:
        part.unlink()


class CapturesFile:
    """A captures.h5 open for appending rows, batch by batch (one writer thread at a time).

    `create` makes a new file with every attribute up front (SWMR forbids new attributes
    later); `reopen` continues an interrupted one from `completed`, dropping rows past it.
    A file with no rows stays closed (a new one is not on disk) until its first batch.
    `close(error)` sets the final status. Room for each batch is reserved before HDF5
    writes it (io/storage.py): a full disk then fails cleanly and the file still closes as
    `failed`; a write HDF5 itself failed leaves the file as it was after the last batch.
    """

    def __init__(
        self, path: Path, options: FileOptions, new: tuple[Provenance | Mapping, bool] | None
    ) -> None:
        self.path = Path(path)
        self.options = options
        self.file: h5py.File | None = None  # open for appending (None: until a batch comes)
        # A file not on disk yet: its header and whether it may replace an existing one.
        self.new = new
        self.rows = 0
        # Open handles, looked up once: a path lookup per dataset per batch is most of the
        # writer's time on small batches.
        self.datasets: dict[str, h5py.Dataset] = {}
        self.keys: set[str] = set()
        self.batch: dict[str, int] = {}  # key → rows per batch-row (0: one row per sample)
        # Sparse records: group path → its counts, values and latent datasets, and width.
        self.sparse: dict[str, tuple[h5py.Dataset, ...]] = {}
        self.widths: dict[str, int] = {}
        self.broken = False  # HDF5 failed a write: the handle must not flush again

    def _use(self, file: h5py.File) -> None:
        """Append to `file` from here (its datasets of rows, rows and layout as it holds
        them; the whole-run datasets get no rows)."""
        self.file = file
        self.rows = read_state(file).completed
        names = dataset_names(file)
        groups = sparse_groups(file)
        parts = {f"{g}/{p}" for g in groups for p in SPARSE_PARTS}
        self.datasets = {k: file[k] for k in names if not is_whole_run(file[k]) and k not in parts}
        self.sparse = {g: tuple(file[f"{g}/{p}"] for p in SPARSE_PARTS) for g in groups}
        self.widths = {g: sparse_spec(file[g])[0][-1] for g in groups}
        self.keys = set(self.datasets) | set(self.sparse)
        self.batch = {k: per_batch(ds) for k, ds in self.datasets.items()}
        self.batch.update({g: 0 for g in groups})  # one row per sample, always

    @classmethod
    def create(
        cls,
        path: Path,
        header: Provenance | Mapping[str, Any],
        options: FileOptions,
        overwrite: bool = False,
    ) -> CapturesFile:
        """A new file at `path`, made when the first batch comes (or the run ends)."""
        return cls(path, options, (header, overwrite))

    @classmethod
    def reopen(cls, path: Path, options: FileOptions) -> CapturesFile:
        """Continue an interrupted, cleanly closed file (io/stored.py's `reopen` first
        copies a killed writer's file into one); one with no rows yet stays closed until
        its first batch."""
        out = cls(path, options, None)
        # In SWMR mode from the first moment: killed here, the file still opens with its rows.
        f = open_swmr_writer(path)
        try:
            completed = read_state(f).completed
            for key in dataset_names(f):  # rows past `completed` may be half written
                f[key].resize(rows_for(f[key], completed), axis=0)
            mark_status(f, "running")
            f.flush()
            out._use(f)
            if not out.keys:  # no batch yet: its datasets are made when it comes (not SWMR)
                f.close()
                out.file = None
        except BaseException:
            f.close()  # no handle left open on a file the run gives up on
            raise
        return out

    def _part(self) -> Path:
        """Where a new file is made before it takes its name: beside it, a name of its own
        (`.{path.name}…` could pass the file system's 255 bytes), the same for every run of
        that path, so the next one removes what a killed one left."""
        digest = hashlib.sha256(self.path.name.encode()).hexdigest()[:16]
        return self.path.with_name(f".hookrun-{digest}.part.h5")

    def _begin(self) -> None:
        """Open the file for its first batch. A new one is made under another name and takes
        its own once SWMR is on (`_named`): the path never names a file HDF5 holds open
        without SWMR, which no reader could open after a kill."""
        if self.new is None:
            self._use(h5py.File(self.path, "r+", libver="latest"))
            return
        part = self._part()
        part.unlink(missing_ok=True)  # left by a killed run (the writer lock is ours)
        f = h5py.File(part, "w-", libver="latest")
        try:
            write_header(f, self.new[0])
            mark_status(f, "running")
            mark_completed(f, 0)
        except BaseException:
            f.close()
            part.unlink(missing_ok=True)
            raise
        self._use(f)

    def _named(self) -> None:
        """A new file, made under another name, takes its own."""
        if self.new is not None:
            _give_name(self._part(), self.path, self.new[1])
            self.new = None

    def append(self, arrays: Mapping[str, np.ndarray | SparseRows]) -> None:
        """Write one batch (every key, same row count), then flush and advance `completed`.
        The `sample` coordinate (/sample) repeats /samples/index, in files that have it
        (every new one with dataset indices; not one of hookrun 0.1.0, which is resumed as
        it began). A key of FileOptions.sparse takes SparseRows of numpy arrays (io/sink.py
        `host_rows` makes them): its counts append as the batch's rows, its values and latent
        after the entries already there."""
        if SAMPLES_INDEX in arrays and (SAMPLE in self.keys or not self.keys):
            arrays = {**arrays, SAMPLE: arrays[SAMPLES_INDEX]}
        if self.file is None:
            self._begin()
        if not self.keys:
            for key, array in arrays.items():
                if isinstance(array, SparseRows):
                    self._create_sparse(key, array)
                else:
                    self._create(key, array)
            make_constants(self.file, self.options.constants, self.options.checksum)
            make_pending(self.file, self.options.finishes, self.options.checksum)
            # Scales write attributes, which SWMR forbids: every axis is named first.
            name_dimensions(self.file, self.options.axes, self.options.checksum)
            write_attrs(self.file, self.options.attrs)  # SWMR allows no new attributes
            self.file.swmr_mode = True  # all datasets exist: from here a kill loses nothing
            self._named()
        if set(arrays) != self.keys:
            raise RuntimeError(
                f"batch keys changed: missing {sorted(self.keys - set(arrays))}, "
                f"new {sorted(set(arrays) - self.keys)}"
            )
        n = {len(a) for k, a in arrays.items() if not self.batch[k]}
        if len(n) != 1 or any(len(a) != 1 for k, a in arrays.items() if self.batch[k]):
            raise RuntimeError(f"records of one batch differ in length: {n}")
        count = n.pop()
        # A record with no batch axis is one row per batch: its index comes from the batch
        # size the dataset itself records (a reopened file needs no options to continue).
        spans = {k: (self.rows // b, 1) if b else (self.rows, count) for k, b in self.batch.items()}
        datasets = self.datasets
        sparse = {k: a for k, a in arrays.items() if k in self.sparse}
        self._check_sparse(sparse, count)  # before any byte: a bad batch leaves the file
        plain = [datasets[k] for k in arrays if not self.batch[k] and k not in sparse]
        plain += [self.sparse[k][0] for k in sparse]  # counts: a row per sample
        need = storage.batch_need(plain, self.rows, count)
        once = [k for k in arrays if self.batch[k]]
        if once:
            need += storage.batch_need([datasets[k] for k in once], spans[once[0]][0], 1)
        for key, rows in sparse.items():
            entries = self.sparse[key][1:]
            if rows.nnz:  # the margin for HDF5's own bytes is in `need` once already
                extra = storage.batch_need(list(entries), len(entries[0]), rows.nnz)
                need += extra - storage.RESERVE_MARGIN
        storage.reserve(self.file, need)  # refused: HDF5 untouched
        try:
            for key, array in arrays.items():
                if key in sparse:
                    self._write_sparse(key, array)
                    continue
                start, rows = spans[key]
                datasets[key].resize(start + rows, axis=0)
                datasets[key][start : start + rows] = array
            self.file.flush()  # the data is on its way to disk before `completed` says so
            mark_completed(self.file, self.rows + count)
            self.file.flush()
        except (OSError, RuntimeError):
            self.broken = True
            raise
        self.rows += count

    def _create(self, key: str, array: np.ndarray) -> None:
        floating = np.issubdtype(array.dtype, np.floating)
        dtype = np.dtype(self.options.dtype_of(key)) if floating else array.dtype
        if dtype.kind == "S":  # stored as UTF-8, not HDF5's default ASCII
            dtype = h5py.string_dtype("utf-8", dtype.itemsize)
        row = tuple(array.shape[1:])
        fold = self.options.folds.get(key, 1)
        self.batch[key] = self.options.batch_size if fold == 0 else 0
        expected = self.options.expected_rows
        if expected and fold == 0:
            expected = -(-expected // self.options.batch_size)
        self.keys.add(key)
        ds = self.datasets[key] = self.file.create_dataset(
            key,
            shape=(0, *row),
            maxshape=(None, *row),
            # The rows one append writes: a batch of samples; one row for per-batch records.
            chunks=chunk_shape(row, dtype.itemsize, expected, self._write_rows(fold)),
            dtype=dtype,
            compression=self.options.compression,
            fletcher32=self.options.checksum,
            track_times=False,  # same numbers → same bytes, whenever the run happened
        )
        mark_rows(ds, fold, self.options.batch_size)
        if self.options.dtype_of(key) == "bfloat16" and array.dtype == np.uint16:
            mark_bfloat16(ds)  # only floats reach the file as uint16

    def _check_sparse(self, sparse: Mapping[str, SparseRows], count: int) -> None:
        """Refuse a sparse record that is no SparseRows, of other rows or token axes than
        its dataset, or whose parts disagree."""
        for key, rows in sparse.items():
            if not isinstance(rows, SparseRows):
                raise RuntimeError(f"{key}: a sparse record takes SparseRows, not {type(rows)}")
            counts = self.sparse[key][0]
            if tuple(rows.counts.shape) != (count, *counts.shape[1:]):
                raise RuntimeError(
                    f"{key}: counts of shape {tuple(rows.counts.shape)}; valid: "
                    f"{(count, *counts.shape[1:])} (the batch's rows, the record's tokens)"
                )
            try:
                check_rows(rows, self.widths[key], key)
            except ValueError as err:
                raise RuntimeError(str(err)) from None

    def _write_sparse(self, key: str, rows: SparseRows) -> None:
        """Counts as the batch's rows, values and latent after the entries there."""
        counts, values, latent = self.sparse[key]
        counts.resize(self.rows + len(rows), axis=0)
        counts[self.rows :] = rows.counts
        start = len(values)
        for ds, part in ((values, rows.values), (latent, rows.latent)):
            ds.resize(start + rows.nnz, axis=0)
            if rows.nnz:
                ds[start:] = part

    def _create_sparse(self, key: str, rows: SparseRows) -> None:
        """The group of a sparse record, marked, with its three datasets (before SWMR)."""
        if key not in self.options.sparse:
            raise RuntimeError(
                f"{key}: SparseRows for a key FileOptions.sparse does not declare; valid: "
                f"{sorted(self.options.sparse) or 'none declared'}"
            )
        shape, dims = SparseSpec(*self.options.sparse[key])
        shape, dims = tuple(int(n) for n in shape), tuple(str(d) for d in dims)
        if not shape or len(dims) != len(shape) + 1 or min(shape) < 1 or dims[0] != SAMPLE:
            raise RuntimeError(
                f"{key}: sparse shape {shape} with dims {dims}; valid: a dense per-sample "
                "shape (*lead, width) of sizes >= 1 and a name per axis, the sample axis first"
            )
        options, lead = self.options, shape[:-1]
        group = self.file.require_group(key)
        mark_sparse(group, shape, dims)
        common = {
            "compression": options.compression,
            "fletcher32": options.checksum,
            "track_times": False,
        }
        counts = group.create_dataset(
            "counts",
            shape=(0, *lead),
            maxshape=(None, *lead),
            chunks=chunk_shape(lead, 4, options.expected_rows, options.batch_size),
            dtype=np.int32,
            **common,
        )
        stored = options.dtype_of(key)
        bits = stored == "bfloat16"
        made = []
        for name, dtype in (("values", np.uint16 if bits else stored), ("latent", np.int32)):
            made.append(
                group.create_dataset(
                    name, shape=(0,), maxshape=(None,), chunks=(ENTRY_CHUNK,), dtype=dtype, **common
                )
            )
        if bits:
            mark_bfloat16(made[0])
        self.sparse[key] = (counts, *made)
        self.widths[key] = shape[-1]
        self.keys.add(key)
        self.batch[key] = 0

    def _write_rows(self, fold: int) -> int:
        return self.options.batch_size if fold else 1  # a folded record is (N, k, ...)

    def close(self, error: BaseException | None = None, interrupted: bool = False) -> None:
        """Final status (`complete`; `failed` or `interrupted` with the error recorded), then
        close. A broken handle is closed without writing: the file stays `running` with
        every row up to `completed` intact, which `resume=true` continues (a new file that
        had not taken its name yet is dropped: it holds no row)."""
        if self.broken:
            storage.abandon(self.file)
            if self.new is not None:
                self._part().unlink(missing_ok=True)
            return
        if self.file is None:  # no batch came: the header and the status, closed
            self._begin()
        try:
            if error is None:
                if self.options.summaries is not None:  # of every row, then the mark
                    self.options.summaries(self.file, self.rows, None)
                # With whole-run work to come the file stays `running` until it is done
                # (io/whole_run.py `finishing` marks it complete).
                if not pending_of(self.file, list(self.options.finishes)):
                    mark_status(self.file, "complete")
            else:
                status = "interrupted" if interrupted else "failed"
                mark_status(self.file, status, f"{type(error).__name__}: {error}")
            self.file.close()
            self._named()
            storage.trim(self.path)
        except (OSError, RuntimeError):
            self.broken = True
            storage.abandon(self.file)
            raise
