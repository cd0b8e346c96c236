"""Walks over a captures.h5's groups: every capture, every derived result, and every dataset
of a stage's group (/evaluate, /sanity, ...), found by the names io/layout.py spells. The
datasets they give read as numbers (io/encoding.py's `decoded`: a bfloat16 dataset's bits as
float32)."""

from __future__ import annotations

from typing import Any

import h5py

from hookrun.io.encoding import Decoded, decoded
from hookrun.io.layout import CAPTURES, DERIVED, is_dimension

__all__ = ["captures_of", "derived_of", "group_of"]


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
    """A stage's group (`/evaluate`, `/sanity`): each subgroup → its datasets by name, at
    any depth."""
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
