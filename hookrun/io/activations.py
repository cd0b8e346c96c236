"""Captured language-model tensors as token vectors, to train an SAE, a transcoder or a probe.

Read from the file a block of rows at a time, real tokens only (padding skipped through the
stored mask), rows the file counts as complete only (a running or killed run's file works):

- `TokenBatches(path, keys, batch_size=4096, buffer=...)`: an IterableDataset of shuffled
  batches, one (B, D) tensor per key (several keys: the same tokens, e.g. a layer's input
  and output), whole blocks read in order and shuffled inside a buffer of `buffer` tokens;
  its memory is the buffer, whatever the corpus.
- `Activations(path, key)`: a map-style Dataset whose item i is the feature vector (D,) of
  the i-th real token; one Python call per token (a probe over a few thousand tokens).

A capture of listed positions (`args.positions: [0, -1]`, (N, P, D), its attribute
`positions` says which) holds real tokens only (a listed position past a row's real tokens
is refused before the run), so every stored position is a token; a capture of one position
per row (`args.positions: last`, (N, D)) has one token per row. A sparse record's key (a
group of counts, values and latent: io/sparse.py) reads the same, each token's vector dense.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from hookrun.io.encoding import bits_to_float32, is_bfloat16
from hookrun.io.layout import (
    CAPTURES,
    LISTED_POSITIONS,
    SAMPLES_MASK,
    SPARSE_COUNTS,
    SPARSE_VALUES,
    open_readonly,
    read_state,
    sparse_spec,
)
from hookrun.io.sparse_record import SparseRecord

__all__ = ["Activations", "TokenBatches"]


@dataclass(frozen=True)
class _Tokens:
    """Where a capture's tokens are.

    Its complete rows, positions stored per row (T, P, or 1 for (N, D)), features, HDF5
    chunk rows, and whether /samples/mask says which of its positions are real tokens (else
    every stored position is one).
    """

    rows: int
    per_row: int
    features: int
    chunk_rows: int
    masked: bool

    def real(self, f: h5py.File, start: int, stop: int) -> np.ndarray | None:
        """The (stop − start, per_row) mask of rows [start, stop); None: all real."""
        return f[SAMPLES_MASK][start:stop].astype(bool) if self.masked else None

    def count(self, f: h5py.File, block: int) -> int:
        """Real tokens in the complete rows, the mask read `block` rows at a time."""
        if not self.masked:
            return self.rows * self.per_row
        return sum(
            int(self.real(f, at, min(at + block, self.rows)).sum())
            for at in range(0, self.rows, block)
        )


def _sparse_tokens(f: h5py.File, key: str) -> _Tokens:
    """Where a sparse record's tokens are: as a dense capture of its dense shape."""
    dense, _ = sparse_spec(f[key])
    if len(dense) not in (1, 2):
        raise ValueError(
            f"{key} has dense shape {dense} per row; valid: a sparse record of (T, D) or (D,)"
        )
    counts = f[key][SPARSE_COUNTS]
    rows = min(read_state(f).completed, len(counts))
    per_row, features = (1, dense[0]) if len(dense) == 1 else dense
    masked = len(dense) == 2 and SAMPLES_MASK in f and f[SAMPLES_MASK].shape[1] == per_row
    chunk_rows = counts.chunks[0] if counts.chunks else 64
    return _Tokens(rows, per_row, features, chunk_rows, masked)


def _reader(f: h5py.File, key: str) -> Callable[[int, int], tuple[np.ndarray, bool]]:
    """What reads rows [start, stop) of a key.

    A capture's as stored (True for a bfloat16 one's bits), a sparse record's as dense
    float32 (one SparseRecord, its offsets computed once).
    """
    node = f[key]
    if sparse_spec(node) is not None:
        record = SparseRecord(node)
        return lambda start, stop: (record[start:stop], False)
    bits = is_bfloat16(node)
    return lambda start, stop: (node[start:stop], bits)


def _tokens(f: h5py.File, key: str) -> _Tokens:
    if key in f and sparse_spec(f[key]) is not None:
        return _sparse_tokens(f, key)
    if key not in f or not isinstance(f[key], h5py.Dataset):
        captures = sorted(k for k in f.get(CAPTURES, {}))
        raise KeyError(
            f"{key}: no such dataset in {f.filename}; valid: a capture such as "
            f"{CAPTURES}/<module>/<site> (modules captured: {', '.join(captures) or 'none'})"
        )
    ds = f[key]
    if not (np.issubdtype(ds.dtype, np.floating) or is_bfloat16(ds)):
        raise ValueError(f"{key} holds {ds.dtype}; valid: a capture of floats")
    if ds.ndim not in (2, 3):
        raise ValueError(
            f"{key} has shape {ds.shape}; valid: a (N, T, D) capture, (N, P, D) of listed "
            "positions, or (N, D) of one position per row"
        )
    rows = read_state(f).completed
    one_per_row = ds.ndim == 2  # positions: last, every row a real token
    per_row, features = (1, ds.shape[1]) if one_per_row else ds.shape[1:]
    listed = LISTED_POSITIONS in ds.attrs  # (N, P, D): every stored position a real token
    # A file from before the attribute: P listed positions where the mask's T differs.
    masked = (
        not one_per_row and not listed and SAMPLES_MASK in f and f[SAMPLES_MASK].shape[1] == per_row
    )
    chunk_rows = ds.chunks[0] if ds.chunks else 64
    return _Tokens(rows, per_row, features, chunk_rows, masked)


class Activations(Dataset):
    """Token i of a capture as a float32 tensor (D,): a map-style Dataset.

    The capture is (N, T, D), (N, P, D) of listed positions, or (N, D) of one position per
    row; item i is the i-th real token of the rows complete when it was opened. Sequential
    reads (a sampler that walks blocks in order, or shuffling inside blocks) read each block
    once. For shuffled batches to train on, TokenBatches is faster by far.
    """

    def __init__(self, path: str | Path, key: str, block: int | None = None) -> None:
        """Read where the capture's real tokens are (the mask, once).

        Args:
            path: The captures.h5.
            key: The capture's path in the file, e.g. `captures/blocks.0/output`.
            block: Rows per read; default: the dataset's HDF5 chunk rows.

        Raises:
            KeyError: The file has no dataset `key` (the message lists the captured modules).
            ValueError: The dataset does not hold floats, or is not 2- or 3-dimensional.
            OSError: The file cannot be opened.
        """
        self.path, self.key = Path(path), key
        with open_readonly(self.path) as f:
            layout = _tokens(f, key)
            # Flat positions n * T + t of the real tokens; None: every position is one.
            mask = layout.real(f, 0, layout.rows)
        self.real = None if mask is None else np.flatnonzero(mask.reshape(-1))
        self.block = block or layout.chunk_rows
        self.tokens, self.features, self.rows = layout.per_row, layout.features, layout.rows
        self._cache: tuple[int, np.ndarray] | None = None
        self._file = None  # opened on first read, in the process (DataLoader worker) reading
        self._read: Callable[[int, int], tuple[np.ndarray, bool]] | None = None

    def __len__(self) -> int:
        """The real tokens in the capture's complete rows."""
        return len(self.real) if self.real is not None else self.rows * self.tokens

    def __getitem__(self, i: int) -> torch.Tensor:
        """The i-th real token's feature vector.

        Args:
            i: The token's index, 0 <= i < len(self).

        Returns:
            A float32 tensor (D,).

        Raises:
            IndexError: `i` is out of range.
        """
        if not 0 <= i < len(self):
            raise IndexError(i)
        flat = int(self.real[i]) if self.real is not None else i
        row, token = divmod(flat, self.tokens)
        start = row - row % self.block
        if self._cache is None or self._cache[0] != start:
            if self._file is None:
                self._file = open_readonly(self.path)
            stop = min(start + self.block, self.rows)
            if self._read is None:
                self._read = _reader(self._file, self.key)
            block, bits = self._read(start, stop)
            block = bits_to_float32(block) if bits else np.asarray(block)
            self._cache = (start, block.reshape(stop - start, self.tokens, self.features))
        return torch.from_numpy(np.array(self._cache[1][row - start, token], dtype=np.float32))


class TokenBatches(IterableDataset):
    """Shuffled batches of token vectors from captures of a captures.h5: an IterableDataset.

    One key, or several of the same rows and positions: their vectors stay together, token
    by token.

    Each iteration reads the file's blocks of `block` rows (default: the first key's HDF5
    chunk rows) whole and in order, keeps their real tokens in a buffer of `buffer` tokens in
    the file's own dtype, and yields `batch_size` tokens drawn from the buffer at random
    (seeded by `seed` and the epoch, `set_epoch`) as one `dtype` tensor (B, D) — a tuple of
    them for several keys — then refills the drawn slots from the blocks that follow. Every
    real token of the rows complete when the iteration starts comes out once per epoch; the
    last batch is short unless `drop_last`. With `shuffle=False` the tokens come in file
    order. In DataLoader workers (`batch_size=None`: the batches are made here) each worker
    reads its share of the blocks into a buffer of its own: memory is workers × buffer × the
    keys' D × the stored element size; the loader interleaves the workers' batches (not file
    order with `shuffle=False`), and each worker's last batch may be short. With
    `persistent_workers=True` the workers keep the epoch they started with: call
    `set_epoch` on a reader whose workers are made anew each epoch.
    """

    def __init__(
        self,
        path: str | Path,
        keys: str | Sequence[str],
        batch_size: int = 4096,
        buffer: int = 2**18,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        block: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """Check the keys and read the rows complete now (the epoch's rows).

        Args:
            path: The captures.h5.
            keys: One capture's path (`captures/blocks.0/output`), or several of the same
                rows and positions.
            batch_size: Tokens per batch.
            buffer: Tokens kept to shuffle among (at least two batches).
            seed: The shuffle's seed, with the epoch.
            shuffle: False: the tokens in file order.
            drop_last: Whether to leave out the last, short batch.
            block: Rows per read; default: the first key's HDF5 chunk rows.
            dtype: The batches' dtype: torch.float32, float16, bfloat16 or float64.

        Raises:
            KeyError: The file has no dataset of one of the keys.
            ValueError: A bad argument (`batch_size`, `buffer` or `block` not an integer
                >= 1, no keys or one twice, another dtype), a dataset that does not hold
                floats or is not 2- or 3-dimensional, or keys of different rows or
                positions.
            OSError: The file cannot be opened.
        """
        self.path = Path(path)
        self.keys = [keys] if isinstance(keys, str) else list(keys)
        for name, value in (("batch_size", batch_size), ("buffer", buffer), ("block", block)):
            if name == "block" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {value!r}; valid: an integer >= 1")
        if not self.keys or len(set(self.keys)) != len(self.keys):
            raise ValueError(f"keys: {self.keys}; valid: one or more captures, each once")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"dtype: {dtype}; valid: torch.float32, float16, bfloat16, float64")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.drop_last, self.dtype = drop_last, dtype
        # A buffer holds at least two batches: one drawn while the rest stay to mix.
        self.buffer = max(buffer, 2 * batch_size)
        self.epoch = 0
        with open_readonly(self.path) as f:
            layouts = [_tokens(f, key) for key in self.keys]
            stored = {_stored_dtype(f[key]) for key in self.keys}
        first = layouts[0]
        for key, layout in zip(self.keys[1:], layouts[1:], strict=True):
            if (layout.rows, layout.per_row, layout.masked) != (
                first.rows,
                first.per_row,
                first.masked,
            ):
                raise ValueError(
                    f"keys: {key} stores {layout.per_row} positions per row of {layout.rows} "
                    f"rows, {self.keys[0]} {first.per_row} of {first.rows}; valid: captures "
                    "of the same rows and positions"
                )
        self.widths = [layout.features for layout in layouts]
        self.block = block or first.chunk_rows
        # The rows an epoch reads, counted here (and at set_epoch) in the parent process:
        # DataLoader workers, each counting when it starts, could see a growing file differ.
        self.rows = first.rows
        self.stored = stored.pop() if len(stored) == 1 else torch.float32  # the buffer's

    def set_epoch(self, epoch: int) -> None:
        """Another shuffle for another epoch, as DistributedSampler.set_epoch.

        The epoch reads the rows complete now (a file a run is still writing has grown).

        Args:
            epoch: The epoch, seeding the shuffle with `seed`.
        """
        self.epoch = epoch
        with open_readonly(self.path) as f:
            self.rows = _tokens(f, self.keys[0]).rows

    def __len__(self) -> int:
        """Batches of an epoch in one process.

        In DataLoader workers each worker's last batch may be short: as many more as there
        are workers.
        """
        with open_readonly(self.path) as f:
            layout = _tokens(f, self.keys[0])
            count = replace(layout, rows=min(layout.rows, self.rows)).count(f, self.block)
        whole, rest = divmod(count, self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[torch.Tensor | tuple[torch.Tensor, ...]]:
        """The epoch's batches: this DataLoader worker's share of the blocks, else all.

        Yields:
            One `dtype` tensor (B, D) per batch; for several keys, a tuple of them, one per
                key.
        """
        worker = get_worker_info()
        share, shares = (worker.id, worker.num_workers) if worker else (0, 1)
        seeded = np.random.SeedSequence([self.seed, self.epoch, share]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(seeded))
        with open_readonly(self.path) as f:
            layouts = [replace(_tokens(f, key), rows=self.rows) for key in self.keys]
            starts = list(range(0, self.rows, self.block))[share::shares]
            stream = self._blocks(f, layouts, starts)
            if self.shuffle:
                yield from self._shuffled(stream, generator)
            else:
                yield from self._in_order(stream)

    def _blocks(
        self, f: h5py.File, layouts: list[_Tokens], starts: list[int]
    ) -> Iterator[torch.Tensor]:
        """Each block's real tokens, (M, the keys' D summed), in the buffer's dtype."""
        rows = layouts[0].rows
        mask = f[SAMPLES_MASK] if layouts[0].masked else None
        readers = [_reader(f, key) for key in self.keys]  # looked up once
        for start in starts:
            stop = min(start + self.block, rows)
            real = None
            if mask is not None:  # flat indices of the real tokens: faster than a bool mask
                real = torch.from_numpy(np.flatnonzero(mask[start:stop]))
            parts = []
            for read, layout in zip(readers, layouts, strict=True):
                values, bits = read(start, stop)
                block = (
                    torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
                    if bits
                    else torch.from_numpy(values)
                )
                block = block.to(self.stored).reshape(-1, layout.features)
                parts.append(block if real is None else block.index_select(0, real))
            yield parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _in_order(self, stream: Iterator[torch.Tensor]):
        pending = torch.empty((0, sum(self.widths)), dtype=self.stored)
        for block in stream:
            pending = torch.cat([pending, block]) if len(pending) else block
            whole = len(pending) // self.batch_size * self.batch_size
            yield from self._emit(pending[:whole])
            pending = pending[whole:]
        yield from self._last(pending)

    def _shuffled(self, stream: Iterator[torch.Tensor], generator: torch.Generator):
        # Fill the buffer, then: draw half of it at random, yield that in batches, refill
        # the drawn slots from the stream. A token stays a random number of draws, so
        # tokens of blocks far apart in the file meet in one batch.
        empty = torch.empty((0, sum(self.widths)), dtype=self.stored)
        store, carry = _take(stream, empty, self.buffer)
        draw = self.buffer // 2 // self.batch_size * self.batch_size
        while len(store) == self.buffer:
            slots = torch.randperm(self.buffer, generator=generator)[:draw]
            yield from self._gathered(store, slots)
            filled, carry = _fill(store, slots, stream, carry)
            if filled < draw:  # the stream ended: the drawn slots left empty go
                keep = torch.ones(self.buffer, dtype=torch.bool)
                keep[slots[filled:]] = False
                left = keep.nonzero()[:, 0]
                order = left[torch.randperm(len(left), generator=generator)]
                whole = len(order) // self.batch_size * self.batch_size
                yield from self._gathered(store, order[:whole])
                if not self.drop_last and whole < len(order):
                    yield self._split(store.index_select(0, order[whole:]))
                return
        order = torch.randperm(len(store), generator=generator)  # the stream was short
        whole = len(order) // self.batch_size * self.batch_size
        yield from self._gathered(store, order[:whole])
        if not self.drop_last and whole < len(order):
            yield self._split(store.index_select(0, order[whole:]))

    def _gathered(self, store: torch.Tensor, slots: torch.Tensor):
        """The rows `slots` of the buffer, `batch_size` at a time, each a tensor of its own."""
        for at in range(0, len(slots), self.batch_size):
            yield self._split(store.index_select(0, slots[at : at + self.batch_size]))

    def _emit(self, vectors: torch.Tensor):
        for at in range(0, len(vectors), self.batch_size):
            yield self._split(vectors[at : at + self.batch_size].clone())

    def _last(self, vectors: torch.Tensor):
        if len(vectors) and not self.drop_last:
            yield self._split(vectors.clone())

    def _split(self, batch: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """A batch (a tensor no one else holds) in `dtype`, split by key."""
        batch = batch.to(self.dtype)
        if len(self.widths) == 1:
            return batch
        return tuple(part.contiguous() for part in batch.split(self.widths, dim=1))


def _stored_dtype(ds: h5py.Dataset | h5py.Group) -> torch.dtype:
    """The torch dtype a capture's values are kept in: its own float (bfloat16's bits).

    A sparse record's: that of its values.
    """
    if sparse_spec(ds) is not None:
        ds = ds[SPARSE_VALUES]
    if is_bfloat16(ds):
        return torch.bfloat16
    return {np.float16: torch.float16, np.float64: torch.float64}.get(ds.dtype.type, torch.float32)


def _fill(
    store: torch.Tensor, slots: torch.Tensor, stream: Iterator[torch.Tensor], carry: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """Copy the next vectors of `carry` then `stream` into the rows `slots` of `store`.

    In order, until every slot is filled or the stream ends: how many were, and what is left.
    """
    filled, block = 0, carry
    while filled < len(slots):
        if not len(block):
            block = next(stream, None)
            if block is None:
                return filled, carry[:0]
        n = min(len(block), len(slots) - filled)
        store.index_copy_(0, slots[filled : filled + n], block[:n])
        filled, block = filled + n, block[n:]
    return filled, block


def _take(
    stream: Iterator[torch.Tensor], carry: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next n vectors of `carry` then `stream` (fewer at its end), and what is left."""
    parts, count = [carry], len(carry)
    while count < n:
        block = next(stream, None)
        if block is None:
            break
        parts.append(block)
        count += len(block)
    joined = torch.cat(parts) if len(parts) > 1 else carry
    return joined[:n], joined[n:]
