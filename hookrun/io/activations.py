"""Captured language-model tensors as token vectors, to train an SAE, a transcoder or a probe.

Read from the file a block of rows at a time, real tokens only (padding skipped through the
stored mask), rows the file counts as complete only (a running or killed run's file works):

- `TokenBatches(path, keys, batch_size=4096, buffer=...)`: an IterableDataset of shuffled
  batches, one (B, D) tensor per key (several keys: the same tokens, e.g. a layer's input
  and output), whole blocks read in an order drawn at random into a buffer of `buffer`
  positions and shuffled there; its memory is the buffer, whatever the corpus. An epoch
  resumes at any batch (`batches(start)`) without reading the blocks before it.
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

    An iteration reads the file's blocks of `block` rows (default: the first key's HDF5
    chunk rows) whole, in an order drawn at random, a window of them at a time into a
    buffer of `buffer` stored positions (whole blocks, at least two) in the file's own
    dtype; it permutes the window's real tokens at random and yields them `batch_size` at a
    time as one `dtype` tensor (B, D) — a tuple of them for several keys —, a batch that
    the window does not fill taking the next window's first tokens. Blocks far apart in the
    file share a window, so their tokens meet in one batch; the shuffle is seeded by `seed`
    and the epoch (`set_epoch`). Every real token of the rows complete when the epoch began
    (its constructor or `set_epoch`) comes out once per epoch; the last batch is short
    unless `drop_last`. With `shuffle=False` the tokens come in file order.

    `batches(start)` begins at the epoch's batch `start`: the batches an uninterrupted
    iteration yields from there, bit for bit, for a trainer resumed after a kill; the
    windows before it are not read (their mask is, to count their tokens), nor are the
    skipped batches of its own window gathered. `set_epoch(epoch, start)` does the same for
    DataLoader workers.

    In DataLoader workers (`batch_size=None`: the batches are made here) each worker reads
    its share of the blocks into a buffer of its own: memory is workers × buffer × the keys'
    D × the stored element size; the loader interleaves the workers' batches (not file
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
            buffer: Stored positions (real tokens and padding) kept to shuffle among,
                rounded down to whole blocks, at least two blocks.
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
            _check_count(name, value, 1)
        if not self.keys or len(set(self.keys)) != len(self.keys):
            raise ValueError(f"keys: {self.keys}; valid: one or more captures, each once")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"dtype: {dtype}; valid: torch.float32, float16, bfloat16, float64")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.drop_last, self.dtype = drop_last, dtype
        self.epoch, self.start = 0, 0
        with open_readonly(self.path) as f:
            layouts = [_tokens(f, key) for key in self.keys]
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
        # Blocks are read whole into the buffer, padding and all (one copy, as h5py's own);
        # two at least, so that a window mixes blocks from far apart in the file.
        self.window = max(2, buffer // (self.block * first.per_row))
        self.buffer = self.window * self.block * first.per_row
        # The rows an epoch reads, counted here (and at set_epoch) in the parent process:
        # DataLoader workers, each counting when it starts, could see a growing file differ.
        self.rows = first.rows
        # The buffers of the last iteration, for the next: a fresh one's pages cost the
        # kernel's zeroing at first touch, again each epoch. Taken while an iteration runs
        # (another one at the same time makes its own); left out of a DataLoader worker's
        # copy.
        self._kept: list[np.ndarray] | None = None

    def __getstate__(self) -> dict:
        """What a DataLoader worker gets: all but the kept buffer."""
        return {**self.__dict__, "_kept": None}

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Another shuffle for another epoch, as DistributedSampler.set_epoch.

        The epoch reads the rows complete now (a file a run is still writing has grown): a
        resumed epoch is the same as the one it resumes if the rows are.

        Args:
            epoch: The epoch, seeding the shuffle with `seed`.
            start: The epoch's first batch to yield, for a resumed trainer: in DataLoader
                workers, the loader's batch (the workers' shares are counted from the mask,
                and the workers' roles turned so that the loader's next batch is
                `start`'s); in one process, as `batches(start)`.

        Raises:
            ValueError: `start` is not an integer >= 0.
        """
        _check_count("start", start, 0)
        self.epoch, self.start = epoch, start
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
        """The epoch's batches from `start` on (`set_epoch`): a DataLoader worker's share.

        In one process, every block's; in a DataLoader worker, its share of the blocks.

        Yields:
            One `dtype` tensor (B, D) per batch; for several keys, a tuple of them, one per
                key.
        """
        worker = get_worker_info()
        if worker is None:
            return self._batches(0, 1, self.start)
        share, skip = self._share(worker.id, worker.num_workers)
        return self._batches(share, worker.num_workers, skip)

    def batches(self, start: int = 0) -> Iterator[torch.Tensor | tuple[torch.Tensor, ...]]:
        """The epoch's batches in this process from its batch `start` on.

        Bit for bit the batches `iter(self)` yields from its batch `start` on, without
        reading the windows of blocks before it or gathering its skipped batches.

        Args:
            start: The first batch to yield, 0 <= start (past the epoch's end: none).

        Returns:
            An iterator of one `dtype` tensor (B, D) per batch; for several keys, a tuple of
            them, one per key.

        Raises:
            ValueError: `start` is not an integer >= 0.
        """
        _check_count("start", start, 0)
        return self._batches(0, 1, start)

    def _share(self, worker: int, workers: int) -> tuple[int, int]:
        """The share of the blocks a DataLoader worker reads, and its batches to skip.

        The loader asks its workers in turn, worker 0 first, leaving out those that have
        ended: the loader's first `start` batches are counted out that way from each share's
        batches, and worker i plays the share i places after the one whose turn is next.
        """
        if not self.start:
            return worker, 0
        with open_readonly(self.path) as f:
            layout = replace(_tokens(f, self.keys[0]), rows=self.rows)
            starts = list(range(0, self.rows, self.block))
            tokens = _real_per_block(f, layout, starts, self.block)
        whole = [sum(tokens[share::workers]) for share in range(workers)]
        size = self.batch_size
        left = [n // size if self.drop_last else -(-n // size) for n in whole]
        done, turn = [0] * workers, 0
        for _ in range(min(self.start, sum(left))):
            while done[turn] == left[turn]:
                turn = (turn + 1) % workers
            done[turn], turn = done[turn] + 1, (turn + 1) % workers
        share = (turn + worker) % workers
        return share, done[share]

    def _batches(
        self, share: int, shares: int, skip: int
    ) -> Iterator[torch.Tensor | tuple[torch.Tensor, ...]]:
        """A share of the blocks' batches, from its batch `skip` on."""
        seeded = np.random.SeedSequence([self.seed, self.epoch, share]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(seeded))
        starts = list(range(0, self.rows, self.block))[share::shares]
        if self.shuffle:
            drawn = torch.randperm(len(starts), generator=generator).tolist()
            starts = [starts[i] for i in drawn]
        windows = [starts[at : at + self.window] for at in range(0, len(starts), self.window)]
        # A seed per window, drawn up front: a resumed iteration skips windows without
        # drawing their permutations to reach the same generator state.
        seeds = torch.randint(2**62, (len(windows),), generator=generator).tolist()
        first = skip * self.batch_size  # the first token to yield, of this share's epoch
        with open_readonly(self.path) as f:
            layouts = [replace(_tokens(f, key), rows=self.rows) for key in self.keys]
            kept, self._kept = self._kept, None
            buffer = _Buffer(f, self.keys, layouts, self.block, self.window, kept)
            batch = _Batch(self.widths, self.batch_size, self.dtype)
            at = 0  # tokens of this share's epoch before the window
            for blocks, window_seed in zip(windows, seeds, strict=True):
                real = buffer.real(blocks)
                if at + len(real) <= first:  # every token of it in a skipped batch
                    at += len(real)
                    continue
                buffer.read(blocks)
                if self.shuffle:
                    drawn = torch.Generator().manual_seed(window_seed)
                    real = real[torch.randperm(len(real), generator=drawn)]
                yield from batch.add(buffer.tokens, real[max(0, first - at) :])
                at += len(real)
            if not self.drop_last:
                yield from batch.rest()
            self._kept = buffer.values


def _check_count(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name}: {value!r}; valid: an integer >= {least}")


def _real_per_block(f: h5py.File, layout: _Tokens, starts: list[int], block: int) -> list[int]:
    """Real tokens of each block of `block` rows from `starts`, the mask read a block at a time."""
    if not layout.masked:
        return [(min(at + block, layout.rows) - at) * layout.per_row for at in starts]
    mask = f[SAMPLES_MASK]
    return [int(np.count_nonzero(mask[at : min(at + block, layout.rows)])) for at in starts]


class _Buffer:
    """A window of whole blocks per key, read in place in the file's dtype.

    A dense capture of float16, bfloat16 (its bits), float32 or float64 is read by HDF5
    straight into the buffer (read_direct: one copy, as h5py's own read), padding and all;
    the real tokens are picked out by their flat index when gathered into a batch, not
    copied out first. A sparse record's rows are densified into a float32 buffer.
    """

    def __init__(
        self,
        f: h5py.File,
        keys: list[str],
        layouts: list[_Tokens],
        block: int,
        blocks: int,
        kept: list[np.ndarray] | None,
    ) -> None:
        """A buffer of `blocks` blocks per key; `kept`: an earlier one's arrays to reuse."""
        self.block, self.rows = block, layouts[0].rows
        self.per_row = layouts[0].per_row
        self.mask: _RowsInto | None = None
        if layouts[0].masked:
            mask = f[SAMPLES_MASK]
            self.mask = _RowsInto(mask, np.empty((block, *mask.shape[1:]), mask.dtype))
        self._reads: list[Callable[[int, int, int], None]] = []
        self.tokens: list[torch.Tensor] = []  # each key's buffer, (positions, D)
        self.values: list[np.ndarray] = []  # the same, as numpy arrays HDF5 reads into
        for i, (key, layout) in enumerate(zip(keys, layouts, strict=True)):
            read, values, bits = _reading(f[key], blocks * block, kept[i] if kept else None)
            self._reads.append(read)
            self.values.append(values)
            flat = torch.from_numpy(values.view(np.int16) if bits else values)
            flat = flat.view(torch.bfloat16) if bits else flat
            self.tokens.append(flat.view(-1, layout.features))

    def real(self, starts: list[int]) -> torch.Tensor:
        """The buffer's flat positions of the real tokens of the blocks from `starts`.

        The blocks as `read` puts them, in that order; each block's tokens in file order.
        """
        found = []
        for slot, at in enumerate(starts):
            stop, base = min(at + self.block, self.rows), slot * self.block * self.per_row
            if self.mask is None:
                found.append(np.arange(base, base + (stop - at) * self.per_row))
            else:  # flat indices: one gather of the real tokens, no bool mask's copy
                self.mask(at, stop, 0)
                found.append(np.flatnonzero(self.mask.values[: stop - at]) + base)
        return torch.from_numpy(np.concatenate(found))

    def read(self, starts: list[int]) -> None:
        """Read the blocks from `starts` into the buffer's slots, in that order."""
        for slot, at in enumerate(starts):
            stop = min(at + self.block, self.rows)
            for read in self._reads:
                read(at, stop, slot * self.block)


def _reading(
    node: h5py.Dataset | h5py.Group, rows: int, kept: np.ndarray | None
) -> tuple[Callable[[int, int, int], None], np.ndarray, bool]:
    """What reads a key's rows [start, stop) into its buffer at a row, the buffer.

    The buffer holds `rows` rows (`kept` if it is of their shape and dtype); the bool:
    whether it holds bfloat16's bits.
    """

    def buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if kept is not None and kept.shape == shape and kept.dtype == dtype:
            return kept
        return np.empty(shape, dtype)

    if sparse_spec(node) is not None:
        record = SparseRecord(node)  # its offsets computed once
        values = buffer((rows, *sparse_spec(node)[0]), np.dtype(np.float32))

        def densify(start: int, stop: int, at: int) -> None:
            values[at : at + stop - start] = record[start:stop]

        return densify, values, False
    bits = is_bfloat16(node)
    if bits or node.dtype in (np.float16, np.float32, np.float64):
        values = buffer((rows, *node.shape[1:]), node.dtype)
        return _RowsInto(node, values), values, bits
    values = buffer((rows, *node.shape[1:]), np.dtype(np.float32))  # another float

    def converted(start: int, stop: int, at: int) -> None:
        values[at : at + stop - start] = node[start:stop]

    return converted, values, False


class _RowsInto:
    """Reads a dataset's rows [start, stop) into an array of its dtype, at a row.

    HDF5 copies straight into the array (as h5py's read_direct), through two selections
    made once and moved for each read: h5py's per-read Python costs as much as a tenth of
    the copy of a block from the page cache.
    """

    def __init__(self, node: h5py.Dataset, values: np.ndarray) -> None:
        self.node, self.values = node, values
        self._file = node.id.get_space()
        self._memory = h5py.h5s.create_simple(values.shape)
        self._rest = values.shape[1:]

    def __call__(self, start: int, stop: int, at: int) -> None:
        count, zeros = (stop - start, *self._rest), (0,) * len(self._rest)
        self._file.select_hyperslab((start, *zeros), count)
        self._memory.select_hyperslab((at, *zeros), count)
        self.node.id.read(self._memory, self._file, self.values)


class _Batch:
    """The batch being made: tokens gathered from the buffer into `dtype`, once each.

    A batch drawn whole from one window is one gather (and conversion) per key; one that
    spans two windows is filled in place, part by part.
    """

    def __init__(self, widths: list[int], size: int, dtype: torch.dtype) -> None:
        self.widths, self.size, self.dtype = widths, size, dtype
        self._parts: list[torch.Tensor] | None = None
        self._filled = 0

    def add(self, tokens: list[torch.Tensor], order: torch.Tensor):
        """Yield the batches the buffer's rows `order` (of each key's `tokens`) complete."""
        at = 0
        while at < len(order):
            take = min(self.size - self._filled, len(order) - at)
            index = order[at : at + take]
            at += take
            if not self._filled and take == self.size:
                yield self._out([t.index_select(0, index).to(self.dtype) for t in tokens])
                continue
            if self._parts is None:
                self._parts = [torch.empty((self.size, w), dtype=self.dtype) for w in self.widths]
            for part, values in zip(self._parts, tokens, strict=True):
                part[self._filled : self._filled + take] = values.index_select(0, index)
            self._filled += take
            if self._filled == self.size:
                yield from self.rest()

    def rest(self):
        """Yield the batch made so far, if any (the last, short one)."""
        if self._filled:
            yield self._out([part[: self._filled] for part in self._parts])
        self._parts, self._filled = None, 0

    def _out(self, parts: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return parts[0] if len(parts) == 1 else tuple(parts)
