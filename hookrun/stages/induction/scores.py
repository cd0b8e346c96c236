"""The induction score per head (Olsson et al. 2022), from attention patterns captured on
`dataset=repeated_tokens` (experiment=induction).

A row is b bos tokens (0 or 1) then a sequence of L distinct random tokens repeated. The
token at position p in the second or a later repeat has an earlier copy at p - L; an
induction head attends from p to the token right after that copy, p - L + 1. A head's score
on a row is its attention pattern A[p, p - L + 1] averaged over every such p (b + L ≤ p < T);
its score is the mean over rows. Written once the run's file is complete
(`write_induction`, stage.py's finish): `/induction/rows` (N, layers, heads) and
`/induction/score` (layers, heads) with the layer names in its attribute `layers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.io.dimensions import attach
from hookrun.io.encoding import read_floats
from hookrun.stages.induction.keys import INDUCTION_ROWS, INDUCTION_SCORE, LAYERS_ATTR

__all__ = ["induction_rows", "write_induction", "pattern_layers"]

_CHUNK = 256  # rows read at a time
_ROWS_AXES = ("sample", "layer", "head")  # /induction/rows; /induction/score the last two


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


def pattern_layers(f: h5py.File, modules: Sequence[str]) -> list[str]:
    """The modules (in model order) whose pattern the file holds."""
    return [m for m in modules if layout.pattern_key(m) in f]


def write_induction(path: Path, modules: Sequence[str], length: int, start: int) -> None:
    """`/induction/rows` and `/induction/score` into the complete file at `path`, from the
    patterns of `modules` it holds (in that order); nothing when it holds none."""
    with h5py.File(path, "r+") as f:
        layers = pattern_layers(f, modules)
        if not layers or INDUCTION_SCORE in f:  # none, or written already (resume)
            return
        first = f[layout.pattern_key(layers[0])]
        rows = np.zeros((first.shape[0], len(layers), first.shape[1]), np.float32)
        for i, layer in enumerate(layers):
            ds = f[layout.pattern_key(layer)]
            for lo in range(0, ds.shape[0], _CHUNK):
                chunk = read_floats(ds, slice(lo, lo + _CHUNK)).astype(np.float64)
                rows[lo : lo + len(chunk), i] = induction_rows(chunk, length, start)
        score = rows.astype(np.float64).mean(axis=0).astype(np.float32)
        for key, data in ((INDUCTION_ROWS, rows), (INDUCTION_SCORE, score)):
            f.create_dataset(key, data=data, fletcher32=True, chunks=data.shape)
        attach(f, {INDUCTION_ROWS: _ROWS_AXES, INDUCTION_SCORE: _ROWS_AXES[1:]})
        layout.write_attrs(f, {INDUCTION_SCORE: {LAYERS_ATTR: list(layers)}})
