"""A captured language-model tensor as a token-by-feature matrix for training (an SAE, a
probe): `Activations(path, key)` (key: a capture's path in the file, e.g. the output of
block 1) is a torch Dataset whose item i is the feature vector (D,) of the i-th real token
of the run — padding skipped through the stored mask — read from the file a block of rows
at a time, so memory holds one block, not the corpus. A capture of listed positions
(`args.positions: [0, -1]`, (N, P, D)) holds real tokens only (a listed position past a
row's real tokens is refused before the run), so its items are every stored position; a
capture of one position per row (`args.positions: last`, (N, D)) has one item per row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from hookrun.io.encoding import read_floats
from hookrun.io.layout import SAMPLES_MASK, open_readonly, read_state

__all__ = ["Activations"]


class Activations(Dataset):
    """Token i of a (N, T, D) capture (or of listed positions, (N, P, D)) as a float32
    tensor (D,). Sequential reads (a sampler that walks blocks in order, or shuffling inside
    blocks) read each block once; `block` is the rows per read (default: the dataset's HDF5
    chunk rows). Only the rows the file counts as complete are read (a running or killed
    run's file works)."""

    def __init__(self, path: str | Path, key: str, block: int | None = None) -> None:
        self.path, self.key = Path(path), key
        with open_readonly(self.path) as f:
            ds = f[key]
            rows = read_state(f).completed
            if ds.ndim not in (2, 3):
                raise ValueError(
                    f"{key} has shape {ds.shape}; valid: a (N, T, D) capture, or (N, D) of one "
                    "position per row"
                )
            # (N, D): one position per row (positions: last), every row a real token.
            self.one_per_row = ds.ndim == 2
            self.tokens, self.features = (1, ds.shape[1]) if self.one_per_row else ds.shape[1:]
            self.block = block or (ds.chunks[0] if ds.chunks else 64)
            mask = f[SAMPLES_MASK][:rows] if SAMPLES_MASK in f else None
            if mask is not None and (self.one_per_row or mask.shape[1] != self.tokens):
                mask = None  # listed positions (P, not the T the mask is over): all real
        # Flat positions n * T + t of the real tokens; None: every position is one.
        self.real = np.flatnonzero(mask.reshape(-1)) if mask is not None else None
        self.rows = rows
        self._cache: tuple[int, np.ndarray] | None = None
        self._file = None  # opened on first read, in the process (DataLoader worker) reading

    def __len__(self) -> int:
        return len(self.real) if self.real is not None else self.rows * self.tokens

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        flat = int(self.real[i]) if self.real is not None else i
        row, token = divmod(flat, self.tokens)
        start = row - row % self.block
        if self._cache is None or self._cache[0] != start:
            if self._file is None:
                self._file = open_readonly(self.path)
            stop = min(start + self.block, self.rows)
            self._cache = (start, np.asarray(read_floats(self._file[self.key], slice(start, stop))))
        at = (row - start,) if self.one_per_row else (row - start, token)
        return torch.from_numpy(np.array(self._cache[1][at], dtype=np.float32))
