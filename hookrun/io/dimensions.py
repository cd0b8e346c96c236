"""Named dimensions in a captures.h5: HDF5 dimension scales, as netCDF-4 lays them out.

AXES below says what each axis is called (`axis_names`); this module makes the scales and
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
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import h5py
import numpy as np

from hookrun.io.layout import (
    CAPTURES,
    MODEL_OUTPUT,
    MODEL_VOCABULARY,
    NOT_A_VARIABLE,
    SAE,
    SAMPLE,
    SAMPLES,
    SAMPLES_INDEX,
    SAMPLES_MASK,
    SAMPLES_TOKENS,
    SPARSE_COUNTS,
    dataset_names,
    folded,
    is_whole_run,
    pattern_key,
    per_batch,
    sparse_part,
    sparse_spec,
)

__all__ = [
    "name_axes",
    "BATCH",
    "FOLD",
    "ENTRY",
    "AXES",
    "LAYOUT_AXES",
    "AxisFacts",
    "axis_names",
    "name_dimensions",
    "read_names",
    "attach",
    "check_dimensions",
]

# Per-sample rows are SAMPLE, one dimension for the file whose coordinate is /sample (the
# dataset indices); rows once per batch are BATCH; k rows per sample folded add FOLD. AXES
# names the other axes by path (the first fnmatch pattern that matches; `*` crosses `/`):
# `{layout}` is what the probe found of a capture (LAYOUT_AXES), `{input}` the model input's
# axes; an axis nothing names is `dim_<k>`; `a b|a c d` gives the first alternative of the
# dataset's rank (one path holding maps of different ranks). The stages add the names of
# their datasets (name_axes) when they register.
BATCH = "batch"
FOLD = "fold"
# A sparse record's values and latent (io/layout.py) run along ENTRY: a dimension of the
# record's own group that grows with it (unlimited, empty: netCDF readers size it from the
# datasets attached), one per record because each record has its own number of entries.
ENTRY = "entry"
AXES: dict[str, str] = {
    SAMPLE: SAMPLE,
    SAMPLES_TOKENS: "sample token",
    SAMPLES_MASK: "sample token",
    f"{SAMPLES}/*": "sample",
    MODEL_OUTPUT: "sample class",
    f"{MODEL_VOCABULARY}*": "vocabulary",
    pattern_key("*"): "sample head query key",
    f"{CAPTURES}/*": "sample {layout}",
    f"{SAE}/*": "sample {layout}",  # a spliced dictionary's records: as its action names them
}


def name_axes(rules: Mapping[str, str]) -> None:
    """Add a stage's names (pattern → words, in its order) ahead of those already known:
    a stage's datasets are named by its own rules (hookrun/stage.py registers them)."""
    known = dict(AXES)
    AXES.clear()
    AXES.update(rules)
    AXES.update({k: v for k, v in known.items() if k not in rules})


LAYOUT_AXES = {
    "nchw": ("channel", "y", "x"),
    "nhwc": ("y", "x", "channel"),
    "tokens": ("token", "feature"),
    "vector": ("feature",),
}


@dataclass(frozen=True)
class AxisFacts:
    """What a run knows of the axes of its input (per sample) and captures (per row)."""

    input: tuple[str, ...] = ()
    tensors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def axis_names(path: str, ds: h5py.Dataset, facts: AxisFacts) -> tuple[str, ...]:
    """The dimension names of dataset `path`: its rows' axis (SAMPLE, BATCH; FOLD), then
    what AXES says when it fits the dataset's rank, else `dim_<k>`."""
    rule = next((r for pattern, r in AXES.items() if fnmatchcase(path, pattern)), SAMPLE)
    if "|" in rule:  # alternatives by rank: the first whose words fit the dataset's axes
        options = rule.split("|")
        rule = next((r for r in options if len(r.split()) == len(ds.shape)), options[0])
    part = sparse_part(ds)
    if part is not None:  # its group says: the dense axes but the last, or the entries
        dims = sparse_spec(ds.parent)[1]
        rule = " ".join([SAMPLE, *dims[1:-1]]) if part == SPARSE_COUNTS else ENTRY
    words: list[str] = []
    for word in rule.split():
        if word == "{layout}":
            words += facts.tensors.get(path, ("?",))
        elif word == "{input}":  # the model input's, or what the method explains instead
            words += facts.tensors.get(path) or facts.input or ("?",)
        else:
            words.append(word)
    rows = words[:1] if words[:1] == [SAMPLE] else []
    if rows and per_batch(ds):
        rows = [BATCH]
    elif rows and folded(ds):
        rows.append(FOLD)
    rest = words[1:] if rows else words
    if len(rows) + len(rest) != len(ds.shape) or "?" in rest:
        rest = [f"dim_{k}" for k in range(len(rows), len(ds.shape))]
    return (*rows, *rest)


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


def _depth_first(paths: object) -> list[str]:
    """Paths with every group's datasets before those of the groups below it."""
    return sorted(paths, key=lambda p: (p.count("/"), p))  # type: ignore[arg-type]


def _plan(f: h5py.File, facts: AxisFacts) -> dict[str, tuple[str, ...]]:
    """Every dataset's final names: layout's names, made unique in size along each chain of
    groups (parents are named before their children)."""
    sizes: dict[str, dict[str, int]] = {}  # group → name → size used there
    members: dict[str, set[str]] = {}  # group → the names of what it holds
    out: dict[str, tuple[str, ...]] = {}
    for path in _depth_first(p for p in dataset_names(f) if p != SAMPLE):
        ds, group = f[path], _group(path)
        if group not in members:
            members[group] = set(f[group or "/"].keys())
        shape, names = ds.shape, list(axis_names(path, ds, facts))
        for axis in range(1 if names[0] in _ROWS else 0, len(names)):
            if names[axis] == ENTRY:  # the record's own, growing: no size to keep apart
                continue
            names[axis] = _free(group, names[axis], shape[axis], sizes, members[group])
            sizes.setdefault(group, {})[names[axis]] = shape[axis]
        out[path] = tuple(names)
    return out


def _free(group: str, name: str, size: int, sizes: dict, members: set[str]) -> str:
    """`name`, or `name_<size>` (then `_` more), so that it means one size here and above,
    and no other object of `group` (`members`) has it."""
    candidate = name
    while True:
        used = [sizes.get(g, {}).get(candidate) for g in _above(group)]
        clash = any(u is not None and u != size for u in used) or candidate in _ROWS
        taken = candidate in members and candidate not in sizes.get(group, {})
        if not (clash or taken):
            return candidate
        candidate = f"{name}_{size}" if candidate == name else f"{candidate}_"


class _Scales:
    """The scales of a file by path, found once and then made as needed."""

    def __init__(self, f: h5py.File, checksum: bool) -> None:
        self.f, self.checksum = f, checksum
        self.found: dict[str, h5py.Dataset] = {}
        f.visititems(self._keep)

    def _keep(self, path: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset) and obj.is_scale:
            self.found[path] = obj

    def row(self, name: str) -> h5py.Dataset:
        """The root scale of a row axis (unlimited: it grows with the file)."""
        return self.found.get(name) or self._make("", name, 0, unlimited=True)

    def growing(self, group: str, name: str) -> h5py.Dataset:
        """The unlimited scale `name` of `group` itself (a sparse record's entries)."""
        found = self.found.get(posixpath.join(group, name))
        return found if found is not None else self._make(group, name, 0, unlimited=True)

    def fixed(self, group: str, name: str, size: int) -> h5py.Dataset:
        """The scale `name` of `size` seen from `group` (its own or a group's above)."""
        for g in _above(group):
            found = self.found.get(posixpath.join(g, name))
            if found is not None and len(found) == size:
                return found
        return self._make(group, name, size, unlimited=False)

    def _make(self, group: str, name: str, size: int, unlimited: bool) -> h5py.Dataset:
        ds = self.f.require_group(group or "/").create_dataset(
            name,
            shape=(size,),
            maxshape=(None,) if unlimited or not size else (size,),
            chunks=(max(size, 1),),
            dtype="f4",
            fletcher32=self.checksum,
            track_times=False,
        )
        ds.make_scale(f"{NOT_A_VARIABLE}{size:10d}")
        self.found[posixpath.join(group, name)] = ds
        return ds


def attach(f: h5py.File, names: Names, checksum: bool = True) -> None:
    """Attach the dimensions `names` gives (dataset path → a name per axis, None: none) to
    the datasets of `f`, making the scales they need; /sample, when present, is the
    `sample` coordinate. Axes that already have a scale are left as they are."""
    if SAMPLE in f and not f[SAMPLE].is_scale:
        f[SAMPLE].make_scale(SAMPLE)
    scales = _Scales(f, checksum)
    for path in _depth_first(names):
        ds, group = f[path], _group(path)
        shape = ds.shape
        for axis, name in enumerate(names[path]):
            if name is None or len(ds.dims[axis]):
                continue
            if name in _ROWS:
                scale = scales.row(name)
            elif name == ENTRY:
                scale = scales.growing(group, name)
            else:
                scale = scales.fixed(group, name, shape[axis])
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
        # A whole-run dataset has no row axis, whatever a stage this hookrun lacks named it.
        row = None if is_whole_run(ds) else axis_names(path, ds, AxisFacts())[0]
        if row in _ROWS and names[0] != row:
            damage.append(f"{path}: axis 0 is {names[0]!r}, not the {row!r} dimension")
        for axis, name in enumerate(names):
            if name is None:
                damage.append(f"{path}: axis {axis} has no dimension name")
            elif name not in (*_ROWS, ENTRY) and len(ds.dims[axis][0]) != ds.shape[axis]:
                damage.append(
                    f"{path}: dimension {name!r} has size {len(ds.dims[axis][0])}, axis "
                    f"{axis} {ds.shape[axis]}"
                )
    if SAMPLES_INDEX not in f:  # not a run's file: verify says so already
        return damage
    if SAMPLE not in f:
        return [*damage, f"/{SAMPLE}: missing (the coordinate of the sample dimension)"]
    if not np.array_equal(f[SAMPLE][:completed], f[SAMPLES_INDEX][:completed]):
        damage.append(f"/{SAMPLE}: its values are not /{SAMPLES_INDEX}'s")
    return damage
