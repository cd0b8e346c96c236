"""The induction score per head (Olsson et al. 2022), from attention patterns captured on
`dataset=repeated_tokens` (experiment=induction).

A row is b bos tokens (0 or 1) then a sequence of L distinct random tokens repeated. The
token at position p in the second or a later repeat has an earlier copy at p - L; an
induction head attends from p to the token right after that copy, p - L + 1. A head's score
on a row is its attention pattern A[p, p - L + 1] averaged over every such p (b + L ≤ p < T);
its score is the mean over rows. `/induction/rows` (N, layers, heads) is written batch by
batch (stage.py), `/induction/score` (layers, heads), with the layer names in its attribute
`layers`, once every row is in the file.
"""

from __future__ import annotations

from collections.abc import Sequence

import h5py
import numpy as np

from hookrun.errors import HookrunError
from hookrun.io.encoding import read_floats
from hookrun.stages.induction.keys import INDUCTION_ROWS

__all__ = ["induction_rows", "batch_rows", "induction_score"]

_CHUNK = 256  # rows read at a time


def induction_rows(pattern: np.ndarray, length: int, start: int = 0) -> np.ndarray:
    """(N, heads) scores from patterns (N, heads, T, T) of rows whose repeated sequence has
    `length` tokens and begins at position `start` (1 after a bos)."""
    tokens = pattern.shape[-1]
    query = np.arange(start + length, tokens)
    if not len(query):
        raise HookrunError(
            f"dataset.repeats: rows of {tokens} tokens hold no second repeat of {length} "
            "tokens; valid: repeats >= 2"
        )
    return pattern[:, :, query, query - length + 1].mean(axis=-1)


def batch_rows(patterns: Sequence[np.ndarray], length: int, start: int) -> np.ndarray:
    """(N, layers, heads) scores of one batch from each layer's patterns (N, heads, T, T)."""
    return np.stack([induction_rows(p, length, start) for p in patterns], axis=1)


def induction_score(f: h5py.File, rows: int) -> np.ndarray:
    """(layers, heads): each head's score, the mean over the file's first `rows` rows of
    /induction/rows (float32, as the rows)."""
    ds = f[INDUCTION_ROWS]
    total = np.zeros(ds.shape[1:], np.float64)
    for lo in range(0, rows, _CHUNK):
        total += read_floats(ds, slice(lo, min(rows, lo + _CHUNK))).astype(np.float64).sum(0)
    return (total / max(rows, 1)).astype(np.float32)
