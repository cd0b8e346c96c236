"""Named dimensions in a captures.h5: HDF5 dimension scales, as netCDF-4 lays them out.

io/layout.py says what each axis is called (`axis_names`); this module makes the scales and
attaches them, so `xarray.open_datatree(path, engine="h5netcdf")` sees every per-sample
dataset on one `sample` dimension whose coordinate is /sample (the dataset indices).

How netCDF-4 readers (h5netcdf, netCDF-C) find dimensions, and so what this writes:
- a dimension is a dataset marked as a scale; its name is the dataset's own name, not an
  attribute, and a variable sees the scales of its group and of the groups above it;
- a dimension with values (a coordinate) is a scale that holds them: /sample, at the root,
  so every group inherits it; one with none is an empty scale whose NAME starts with
  netCDF's sentence (`layout.NOT_A_VARIABLE`), made in the group of the first dataset
  that uses it, and shared by the groups below;
- xarray's DataTree wants a name to mean one size in a group and all groups above it, so a
  name already used there with another size gets the size appended (`y_7` beside `y`).
Attaching writes attributes on both datasets, and SWMR allows no new attribute once it has
started: names are attached when the first batch's datasets are made, before SWMR. A copy of
a file (resume's fresh file, the torchrun join of virtual datasets) reads the names back
(`read_names`) and attaches the same ones (`attach`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping

import h5py
import numpy as np

from hookrun.io.layout import (
    BATCH,
    NOT_A_VARIABLE,
    SAMPLE,
    SAMPLES_INDEX,
    AxisFacts,
    axis_names,
    dataset_names,
)

__all__ = ["name_dimensions", "read_names", "attach", "check_dimensions"]

# Row axes: they grow with the file, so their scales are unlimited and live at the root.
_ROWS = (SAMPLE, BATCH)
Names = Mapping[str, tuple[str | None, ...]]


def _group(path: str) -> str:
    return posixpath.dirname(path)


def _above(group: str) -> list[str]:
    """`group` and every group above it, nearest first ('' is the root)."""
    out = [group]
    while group:
        group = _group(group)
        out.append(group)
    return out


def _plan(f: h5py.File, facts: AxisFacts) -> dict[str, tuple[str, ...]]:
    """Every dataset's final names: layout's names, made unique in size along each chain of
    groups (parents are named before their children)."""
    sizes: dict[str, dict[str, int]] = {}  # group → name → size used there
    out: dict[str, tuple[str, ...]] = {}
    paths = [p for p in dataset_names(f) if p != SAMPLE]
    for path in sorted(paths, key=lambda p: (p.count("/"), p)):
        ds, group = f[path], _group(path)
        names = list(axis_names(path, ds, facts))
        for axis in range(1 if names[0] in _ROWS else 0, len(names)):
            names[axis] = _free(f, group, names[axis], ds.shape[axis], sizes)
            sizes.setdefault(group, {})[names[axis]] = ds.shape[axis]
        out[path] = tuple(names)
    return out


def _free(f: h5py.File, group: str, name: str, size: int, sizes: dict) -> str:
    """`name`, or `name_<size>` (then `_` more), so that it means one size here and above,
    and no other object of `group` has it."""
    candidate = name
    while True:
        used = [sizes.get(g, {}).get(candidate) for g in _above(group)]
        clash = any(u is not None and u != size for u in used) or candidate in _ROWS
        taken = candidate in f.get(group or "/", {}) and candidate not in sizes.get(group, {})
        if not (clash or taken):
            return candidate
        candidate = f"{name}_{size}" if candidate == name else f"{candidate}_"


def _scale(f: h5py.File, group: str, name: str, size: int | None, checksum: bool) -> h5py.Dataset:
    """The empty scale `name` of `group` (size None: unlimited), made if absent."""
    where = posixpath.join(group, name)
    if where in f:
        return f[where]
    length = 0 if size is None else size
    ds = f.require_group(group or "/").create_dataset(
        name,
        shape=(length,),
        maxshape=(None,) if size is None or size == 0 else (size,),
        chunks=(max(length, 1),),
        dtype="f4",
        fletcher32=checksum,
        track_times=False,
    )
    ds.make_scale(f"{NOT_A_VARIABLE}{length:10d}")
    return ds


def _find(f: h5py.File, group: str, name: str, size: int) -> h5py.Dataset | None:
    for g in _above(group):
        where = posixpath.join(g, name)
        found = f.get(where)
        if isinstance(found, h5py.Dataset) and found.is_scale and len(found) == size:
            return found
    return None


def attach(f: h5py.File, names: Names, checksum: bool = True) -> None:
    """Attach the dimensions `names` gives (dataset path → a name per axis, None: none) to
    the datasets of `f`, making the scales they need; /sample, when present, is the
    `sample` coordinate. Axes that already have a scale are left as they are."""
    if SAMPLE in f and not f[SAMPLE].is_scale:
        f[SAMPLE].make_scale(SAMPLE)
    for path in sorted(names, key=lambda p: (p.count("/"), p)):
        ds, group = f[path], _group(path)
        for axis, name in enumerate(names[path]):
            if name is None or len(ds.dims[axis]):
                continue
            if name in _ROWS:
                scale = f[name] if name in f else _scale(f, "", name, None, checksum)
            else:
                size = ds.shape[axis]
                scale = _find(f, group, name, size) or _scale(f, group, name, size, checksum)
            ds.dims[axis].attach_scale(scale)


def name_dimensions(f: h5py.File, facts: AxisFacts, checksum: bool = True) -> None:
    """Name every axis of every dataset of a new file (before SWMR starts)."""
    attach(f, _plan(f, facts), checksum)


def read_names(f: h5py.File) -> dict[str, tuple[str | None, ...]]:
    """Each dataset's dimension names as attached (None for an axis with none)."""
    return {
        path: tuple(posixpath.basename(d[0].name) if len(d) else None for d in f[path].dims)
        for path in dataset_names(f)
        if path != SAMPLE
    }


def check_dimensions(f: h5py.File, completed: int) -> list[str]:
    """What is wrong with a file's dimensions: an axis without a name, a row axis that is
    not `sample` (or `batch`), a scale whose size is not its axis's, a /sample that does
    not hold the dataset indices. A file with no dimensions at all (hookrun 0.1.0) has
    nothing wrong."""
    named = read_names(f)
    if not any(n for names in named.values() for n in names) and SAMPLE not in f:
        return []
    damage = []
    for path, names in named.items():
        ds = f[path]
        row = axis_names(path, ds, AxisFacts())[0]
        if row in _ROWS and names[0] != row:
            damage.append(f"{path}: axis 0 is {names[0]!r}, not the {row!r} dimension")
        for axis, name in enumerate(names):
            if name is None:
                damage.append(f"{path}: axis {axis} has no dimension name")
            elif name not in _ROWS and len(ds.dims[axis][0]) != ds.shape[axis]:
                damage.append(
                    f"{path}: dimension {name!r} has size {len(ds.dims[axis][0])}, axis "
                    f"{axis} {ds.shape[axis]}"
                )
    if SAMPLE not in f or SAMPLES_INDEX not in f:
        return [*damage, f"/{SAMPLE}: missing (the coordinate of the sample dimension)"]
    if not np.array_equal(f[SAMPLE][:completed], f[SAMPLES_INDEX][:completed]):
        damage.append(f"/{SAMPLE}: its values are not /{SAMPLES_INDEX}'s")
    return damage
