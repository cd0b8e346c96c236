"""Walks over a captures.h5's groups: every capture, derived result, evaluation curve and
sanity verdict, found by the names io/layout.py spells. The datasets they give read as
numbers (io/encoding.py's `decoded`: a bfloat16 dataset's bits as float32)."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from hookrun.io.encoding import Decoded, decoded, read_floats
from hookrun.io.layout import (
    CAPTURES,
    DERIVED,
    PATCHING_CLEAN,
    PATCHING_CORRUPTED,
    SAMPLES_INDEX,
    SANITY,
    VERDICT_SIMILARITY,
    is_dimension,
    mark_unscorable,
    mark_verdict,
    patching_key,
    read_sanity,
    verdict_of,
)

__all__ = [
    "captures_of",
    "derived_of",
    "group_of",
    "write_summaries",
    "write_verdicts",
    "read_verdicts",
]


Values = h5py.Dataset | Decoded  # a dataset as the numbers it holds


def captures_of(f: h5py.File) -> dict[str, dict[str, Values]]:
    """Every captured layer → its sites → dataset. A function call site's layer holds a
    slash (`block/gelu.0`), so layers are the groups that hold datasets, at any depth."""
    out: dict[str, dict[str, h5py.Dataset]] = {}
    group = f.get(CAPTURES)
    if group is None:
        return out

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and not is_dimension(obj):
            layer, site = name.rsplit("/", 1)
            out.setdefault(layer, {})[site] = decoded(obj)

    group.visititems(visit)
    return out


def derived_of(f: h5py.File) -> dict[str, dict[str, Values]]:
    """Every derived method → its layers → dataset."""
    group = f.get(DERIVED, {})
    return {
        method: {k: decoded(ds) for k, ds in g.items() if not is_dimension(ds)}
        for method, g in group.items()
    }


def group_of(f: h5py.File, name: str) -> dict[str, dict[str, Values]]:
    """`/evaluate` or `/sanity`: each subgroup → its datasets by name, at any depth."""
    out = {}
    for sub, g in f.get(name, {}).items():
        found: dict[str, Values] = {}
        g.visititems(
            lambda n, o, d=found: (
                d.__setitem__(n, decoded(o)) if isinstance(o, h5py.Dataset) else None
            )
        )
        out[sub] = found
    return out


def write_summaries(f: h5py.File, rows: int, shards: list[h5py.File] | None = None) -> None:
    """What a file says of all its rows once they are written (the first `rows`, or the
    `shards` a join reads), before it is marked complete: the sanity verdicts and the rows
    patching could not score."""
    write_verdicts(f, rows, shards)
    _write_unscorable(f, rows, shards)


def _write_unscorable(f: h5py.File, rows: int, shards: list[h5py.File] | None) -> None:
    """The dataset indices of the rows whose clean − corrupted logit difference is 0."""
    keys = (patching_key(PATCHING_CLEAN), patching_key(PATCHING_CORRUPTED), SAMPLES_INDEX)
    if not all(key in f for key in keys):
        return
    parts = [[read_floats(s[key]) for key in keys] for s in shards or []]
    clean, corrupted, index = (
        [np.concatenate(p) for p in zip(*parts, strict=True)]
        if parts
        else [read_floats(f[key], slice(0, rows)) for key in keys]
    )
    mark_unscorable(f, index[clean == corrupted])


def write_verdicts(f: h5py.File, rows: int, shards: list[h5py.File] | None = None) -> None:
    """Each sanity verdict from the first `rows` rows (or the `shards` a join reads), before a
    file is complete: score = mean over steps of the median VERDICT_SIMILARITY < threshold."""
    for method, datasets in group_of(f, SANITY).items():
        if VERDICT_SIMILARITY in datasets and rows:
            ds = datasets[VERDICT_SIMILARITY]
            parts = [read_floats(s[ds.name]) for s in shards or []] or [ds[:rows]]
            score = float(np.mean(np.median(np.concatenate(parts)[:, 1:], axis=0)))
            mark_verdict(f, method, score, score < read_sanity(f)[1])


def read_verdicts(f: h5py.File) -> dict[str, tuple[bool, float] | None]:
    """method → (passed, score), or None where a method's group has no verdict."""
    return {method: verdict_of(f, method) for method in group_of(f, SANITY)}
