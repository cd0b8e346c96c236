"""A features job's file: the run's captures.h5, written whole (to a temporary name beside it,
flushed to the disk, renamed over the old one), so a kill leaves the old file or the new,
each readable. The layout is io/features.py's (docs/architecture.md lists it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io.dimensions import AxisFacts, name_dimensions
from hookrun.io.features import GROUP, JOB, VOCAB, VOCAB_LENGTH, site_group
from hookrun.io.layout import (
    JOB_ATTR,
    MODEL_VOCABULARY,
    MODEL_VOCABULARY_LENGTH,
    Provenance,
    attr,
    has_attrs,
    set_attrs,
    vocabulary_arrays,
    write_header,
)
from hookrun.io.whole_file import replaced_whole

__all__ = ["Written", "write", "is_features_file", "damage", "REQUIRED"]

# What every site's group holds once the job is complete.
REQUIRED = (
    "max",
    "density",
    "top/value",
    "top/row",
    "top/token",
    "quantiles/edges",
    "quantiles/value",
    "quantiles/row",
    "quantiles/token",
    "histogram/edges",
    "histogram/counts",
)


@dataclass(frozen=True)
class Written:
    """One site's part of the file: its group's attributes and datasets."""

    module: str
    site: str
    attrs: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)


def write(
    path: Path,
    header: Provenance,
    sites: list[Written],
    vocab: list[str] | None,
    *,
    status: str,
    error: str,
    rows: int,
) -> None:
    """The whole file, replacing the old one only once it is on disk."""
    with replaced_whole(path) as temp, h5py.File(temp, "w", track_order=True) as f:
        write_header(f, header)
        set_attrs(f, {JOB_ATTR: JOB, "status": status, "error": error, "completed": 0})
        set_attrs(f, {"rows": rows})
        group = f.create_group(GROUP)
        if vocab is not None:  # stored as /model/vocabulary is (a NUL token, checksums)
            arrays = vocabulary_arrays(vocab)
            group.create_dataset(
                VOCAB.rpartition("/")[2], data=arrays[MODEL_VOCABULARY], fletcher32=True
            )
            group.create_dataset(
                VOCAB_LENGTH.rpartition("/")[2],
                data=arrays[MODEL_VOCABULARY_LENGTH],
                fletcher32=True,
            )
        for s in sites:
            g = f.require_group(site_group(s.module, s.site))
            set_attrs(g, dict(s.attrs))
            for name, value in s.arrays.items():
                checked = value.size > 0  # an empty dataset takes no filter
                g.create_dataset(name, data=value, fletcher32=checked, track_times=False)
        name_dimensions(f, AxisFacts())


def is_features_file(f: h5py.File) -> bool:
    return attr(f, JOB_ATTR) == JOB


def damage(f: h5py.File, complete: bool) -> list[str]:
    """What a complete features file lacks: a site's group without one of its datasets."""
    if not complete:
        return []
    if GROUP not in f:
        return [f"/{GROUP}: missing (a features file holds a group per site)"]
    found = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Group) and has_attrs(obj, "units"):
            for part in REQUIRED:
                if part not in obj:
                    found.append(f"/{GROUP}/{name}/{part}: missing")

    f[GROUP].visititems(visit)
    return found
