"""Reading a sparse record back (io/sparse.py, io/layout.py's group of counts, values and
latent): rows as dense float32, or as a scipy CSR matrix of tokens × width, reading from disk
only the entries of the rows asked for.

Where a row's entries start is a cumulative sum of the counts, computed once per record (the
counts read a block of rows at a time) and kept; the rows a record has are those the file
counts as complete (`completed`), so a running or killed run's file reads too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from hookrun.io.layout import (
    SPARSE_COUNTS,
    SPARSE_LATENT,
    SPARSE_VALUES,
    is_bfloat16,
    read_state,
    sparse_spec,
)
from hookrun.io.sparse import SparseRows, decode_values, densify

__all__ = ["SparseRecord", "sparse_damage"]

# Rows of counts summed at a time for the offsets: bounded memory on any file.
_BLOCK = 4096


class SparseRecord:
    """A sparse record of a captures.h5, read as the dense array it stands for.

    `record[rows]` (an int, a slice, a list or array of ints; then any index of the dense
    axes, `record[2:4, 0]`) is dense numpy float32 (bfloat16 decoded), zeros where nothing is
    stored; `to_scipy(rows)` the same rows as a `scipy.sparse.csr_matrix` of (tokens × width).

    Attributes:
        group: The record's h5py group.
        shape: (rows, *dense per-sample shape), e.g. (N, T, d_sae).
        dims: The axes' names, e.g. ("sample", "token", "latent").
    """

    dtype = np.dtype(np.float32)

    def __init__(self, group: h5py.Group, rows: int | None = None) -> None:
        """Open a record's group.

        Args:
            group: The group of a sparse record (io/layout.py `sparse_spec` says so).
            rows: The rows to read; default: those the file counts as complete.

        Raises:
            ValueError: `group` is not a sparse record.
        """
        spec = sparse_spec(group)
        if spec is None:
            raise ValueError(f"{group.name}: not a sparse record (no `sparse: rows` attribute)")
        self.group = group
        self.counts = group[SPARSE_COUNTS]
        self.values = group[SPARSE_VALUES]
        self.latent = group[SPARSE_LATENT]
        self.bfloat16 = is_bfloat16(self.values)
        dense, self.dims = spec
        complete = read_state(group.file).completed if rows is None else rows
        self.rows = min(complete, len(self.counts))
        self.width = dense[-1]
        self.shape = (self.rows, *dense)
        self._offsets: np.ndarray | None = None

    @property
    def name(self) -> str:
        """The group's path in the file."""
        return self.group.name

    @property
    def ndim(self) -> int:
        """Axes of the dense array."""
        return len(self.shape)

    def __len__(self) -> int:
        """The rows."""
        return self.rows

    @property
    def offsets(self) -> np.ndarray:
        """(rows + 1,) int64: where each row's entries start, and where the last ends."""
        if self._offsets is None:
            totals = [np.zeros(1, dtype=np.int64)]
            for at in range(0, self.rows, _BLOCK):
                block = self.counts[at : min(at + _BLOCK, self.rows)]
                totals.append(block.reshape(len(block), -1).sum(1, dtype=np.int64))
            self._offsets = np.cumsum(np.concatenate(totals))
        return self._offsets

    @property
    def nnz(self) -> int:
        """The entries (non-zeros) of the record's rows."""
        return int(self.offsets[-1])

    def _rows(self, key: Any) -> tuple[np.ndarray, bool]:
        """The row indices `key` selects, and whether it was one int (its axis dropped)."""
        if isinstance(key, int | np.integer):
            index = int(key) + (self.rows if key < 0 else 0)
            if not 0 <= index < self.rows:
                raise IndexError(f"row {key} of a record of {self.rows} rows")
            return np.array([index]), True
        if isinstance(key, slice):
            return np.arange(*key.indices(self.rows)), False
        index = np.asarray(key)
        if index.dtype == bool:
            raise IndexError("rows: a boolean mask; valid: an int, a slice, or ints")
        index = index.astype(np.int64).reshape(-1)
        index = np.where(index < 0, index + self.rows, index)
        if index.size and (index.min() < 0 or index.max() >= self.rows):
            raise IndexError(f"rows {np.asarray(key).tolist()} of a record of {self.rows} rows")
        return index, False

    def _runs(self, unique: np.ndarray) -> Iterator[SparseRows]:
        """The stored parts of sorted distinct rows, one read per run of consecutive rows."""
        if not unique.size:
            return
        breaks = np.flatnonzero(np.diff(unique) != 1) + 1
        for run in np.split(unique, breaks):
            first, stop = int(run[0]), int(run[-1]) + 1
            begin, end = int(self.offsets[first]), int(self.offsets[stop])
            yield SparseRows(
                self.counts[first:stop],
                decode_values(self.values[begin:end], self.bfloat16),
                self.latent[begin:end],
            )

    def _read(self, index: np.ndarray) -> np.ndarray:
        """Dense float32 rows `index` (any order, repeats allowed)."""
        unique, inverse = np.unique(index, return_inverse=True)
        parts = [densify(part, self.width) for part in self._runs(unique)]
        dense = np.concatenate(parts) if parts else np.zeros((0, *self.shape[1:]), dtype=np.float32)
        return dense[inverse.reshape(-1)]

    def __getitem__(self, key: Any) -> np.ndarray:
        """Rows as dense float32, e.g. `record[0]`, `record[10:20]`, `record[[3, 1]]`.

        Args:
            key: Rows (an int, a slice, a list or array of ints), or a tuple of rows and an
                index of the dense axes.

        Returns:
            The dense rows (one row's axis dropped for an int), zeros where nothing is stored.

        Raises:
            IndexError: A row outside the record.
        """
        rest: tuple = ()
        if isinstance(key, tuple):
            key, rest = (key[0], key[1:]) if key else (slice(None), ())
        if key is Ellipsis:
            key, rest = slice(None), (Ellipsis, *rest)
        index, one = self._rows(key)
        dense = self._read(index)
        dense = dense[0] if one else dense
        return dense[rest if one else (slice(None), *rest)] if rest else dense

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self[:]
        return values if dtype is None else values.astype(dtype)

    def to_scipy(self, rows: Any = None) -> Any:
        """Rows as a `scipy.sparse.csr_matrix` of (tokens × width), float32.

        Args:
            rows: Rows as `record[rows]` takes them (default: all); their tokens are the
                matrix's rows, row by row, token by token.

        Returns:
            The CSR matrix (its entries exactly those stored).

        Raises:
            IndexError: A row outside the record.
        """
        import scipy.sparse  # a core dependency, but heavy to import: only when asked

        index, _ = self._rows(slice(None) if rows is None else rows)
        unique, inverse = np.unique(index, return_inverse=True)
        per_row = math.prod(self.shape[1:-1])
        counts, values, latent = [], [], []
        for part in self._runs(unique):
            counts.append(np.asarray(part.counts).reshape(len(part), per_row))
            values.append(part.values)
            latent.append(part.latent)
        if not counts:
            return scipy.sparse.csr_matrix((0, self.width), dtype=np.float32)
        counts = np.concatenate(counts)
        values, latent = np.concatenate(values), np.concatenate(latent)
        # Rows in the order asked (repeats too): each row's entries picked by its span.
        starts = np.concatenate([[0], np.cumsum(counts.sum(1, dtype=np.int64))])
        picked = inverse.reshape(-1)
        spans = [np.arange(starts[r], starts[r + 1]) for r in picked]
        take = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(counts[picked].reshape(-1), dtype=np.int64)])
        shape = (len(picked) * per_row, self.width)
        return scipy.sparse.csr_matrix((values[take], latent[take], indptr), shape=shape)

    def __repr__(self) -> str:
        return (
            f"<sparse record {self.name!r}: shape {self.shape} {self.dims}, {self.nnz} "
            "entries, read as float32>"
        )


def sparse_damage(group: h5py.Group, completed: int) -> list[str]:
    """What is wrong with a sparse record's first `completed` rows: entries missing (values
    or latent shorter than the counts promise), a latent index outside [0, width), a count
    outside [0, width]; one line each, naming the group."""
    name = group.name.lstrip("/")
    dense, _ = sparse_spec(group)
    width, counts = dense[-1], group[SPARSE_COUNTS]
    rows = min(completed, len(counts))
    damage = []
    if len(counts) < completed:
        damage.append(f"{name}: sparse record: counts hold {len(counts)} rows, not {completed}")
    total = 0
    for at in range(0, rows, _BLOCK):
        block = counts[at : min(at + _BLOCK, rows)]
        if block.size and (block.min() < 0 or block.max() > width):
            damage.append(f"{name}: sparse record: a count outside [0, {width}]")
            break
        total += int(block.sum(dtype=np.int64))
    short = [
        f"{part} holds {len(group[part])}"
        for part in (SPARSE_VALUES, SPARSE_LATENT)
        if len(group[part]) < total
    ]
    if short:
        damage.append(
            f"{name}: sparse record damaged: {' and '.join(short)} entries, fewer than the "
            f"{total} the counts of its {rows} complete rows need"
        )
    latent = group[SPARSE_LATENT]
    step = max(1, (latent.chunks or (1 << 16,))[0])
    for at in range(0, min(total, len(latent)), step):
        block = latent[at : min(at + step, total)]
        if block.size and (block.min() < 0 or block.max() >= width):
            bad = int(block[(block < 0) | (block >= width)][0])
            damage.append(f"{name}: sparse record damaged: latent index {bad} outside [0, {width})")
            break
    return damage
