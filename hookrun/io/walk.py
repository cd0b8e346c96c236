"""Walks over a captures.h5's groups: every capture, derived result, evaluation curve and
sanity verdict, found by the names io/layout.py spells."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from hookrun.io.layout import (
    CAPTURES,
    DERIVED,
    SANITY,
    VERDICT_SIMILARITY,
    is_dimension,
    mark_verdict,
    read_sanity,
    verdict_of,
)

__all__ = ["captures_of", "derived_of", "group_of", "write_verdicts", "read_verdicts"]


def captures_of(f: h5py.File) -> dict[str, dict[str, h5py.Dataset]]:
    """Every captured layer → its sites → dataset. A function call site's layer holds a
    slash (`block/gelu.0`), so layers are the groups that hold datasets, at any depth."""
    out: dict[str, dict[str, h5py.Dataset]] = {}
    group = f.get(CAPTURES)
    if group is None:
        return out

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and not is_dimension(obj):
            layer, site = name.rsplit("/", 1)
            out.setdefault(layer, {})[site] = obj

    group.visititems(visit)
    return out


def derived_of(f: h5py.File) -> dict[str, dict[str, h5py.Dataset]]:
    """Every derived method → its layers → dataset."""
    group = f.get(DERIVED, {})
    return {
        method: {k: ds for k, ds in g.items() if not is_dimension(ds)}
        for method, g in group.items()
    }


def group_of(f: h5py.File, name: str) -> dict[str, dict[str, h5py.Dataset]]:
    """`/evaluate` or `/sanity`: each subgroup → its datasets by name, at any depth."""
    out = {}
    for sub, g in f.get(name, {}).items():
        found: dict[str, h5py.Dataset] = {}
        g.visititems(
            lambda n, o, d=found: d.__setitem__(n, o) if isinstance(o, h5py.Dataset) else None
        )
        out[sub] = found
    return out


def write_verdicts(f: h5py.File, rows: int, shards: list[h5py.File] | None = None) -> None:
    """Each sanity verdict from the first `rows` rows (or the `shards` a join reads), before a
    file is complete: score = mean over steps of the median VERDICT_SIMILARITY < threshold."""
    for method, datasets in group_of(f, SANITY).items():
        if VERDICT_SIMILARITY in datasets and rows:
            ds = datasets[VERDICT_SIMILARITY]
            parts = [s[ds.name][()] for s in shards or []] or [ds[:rows]]
            score = float(np.mean(np.median(np.concatenate(parts)[:, 1:], axis=0)))
            mark_verdict(f, method, score, score < read_sanity(f)[1])


def read_verdicts(f: h5py.File) -> dict[str, tuple[bool, float] | None]:
    """method → (passed, score), or None where a method's group has no verdict."""
    return {method: verdict_of(f, method) for method in group_of(f, SANITY)}
