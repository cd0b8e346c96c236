"""The captures.h5 layout — the one module that spells its paths and attributes.

| path | shape | meaning |
|---|---|---|
| /captures/<layer>/<site>[_<i>][.call<k>] | (N, ...) | one row per sample, in dataset order |
| /samples/index, /samples/label, /samples/target | (N,) int64 | dataset index, label, target |
| /samples/path | (N,) UTF-8, fixed width | source file of each row (file datasets) |
| /model/output | (N, ...) | the model's output |
| /derived/<method>/<layer> | (N, ...) | raw derived results |
| /derived/<method>/<layer>.completeness_gap | (N,) | Σ attributions − (f(x) − f(baseline)) |
| /sample | (N,) int64 | the `sample` dimension's coordinate: /samples/index's values |

Every axis is a named dimension (AXES below; io/dimensions.py attaches the scales).

Root attributes: the provenance fields below, then `error`, `status` (running → complete |
failed | interrupted) and `completed` (rows written *and flushed*, never ahead of the data).

Captures not stored one row per sample carry a dataset attribute: PER_BATCH (no batch
axis: one row per batch) or FOLDED (k rows per sample folded into the batch axis, (N, k, ...)).

How rows are appended, crash-safely, is io/appender.py's job; the names it writes are here.
Crash safety: SWMR mode once the first batch's datasets exist, a flush every batch; a killed
writer's file opens read-only (`open_readonly`) with every row up to `completed` intact, and
io/stored.py copies them into a fresh file (HDF5 cannot clear a dead writer's mark).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io import storage
from hookrun.io.storage import CHUNK_BYTES, chunk_shape, open_readonly

__all__ = [
    "CHUNK_BYTES",
    "SAMPLES_INDEX",
    "SAMPLES_LABEL",
    "SAMPLES_TARGET",
    "SAMPLES_PATH",
    "path_rows",
    "read_paths",
    "MODEL_OUTPUT",
    "INPUT_PHOTO",
    "INPUT_GRAD",
    "Provenance",
    "FileState",
    "PER_BATCH",
    "FOLDED",
    "per_batch",
    "rows_for",
    "rows_note",
    "copy_attrs",
    "capture_key",
    "derived_key",
    "gap_key",
    "GAP_SUFFIX",
    "chunk_shape",
    "open_readonly",
    "read_state",
    "read_provenance",
    "captures_of",
    "dataset_names",
    "derived_of",
    "write_header",
    "mark_status",
    "mark_completed",
    "mark_rows",
    "mark_complete",
    "SAMPLE",
    "BATCH",
    "FOLD",
    "AXES",
    "LAYOUT_AXES",
    "AxisFacts",
    "axis_names",
    "NOT_A_VARIABLE",
    "SCALE_ATTRS",
    "is_dimension",
]

SAMPLES_INDEX = "samples/index"
SAMPLES_LABEL = "samples/label"
SAMPLES_TARGET = "samples/target"
SAMPLES_PATH = "samples/path"
MODEL_OUTPUT = "model/output"


def capture_key(
    layer: str,
    site: str,
    call: int = 0,
    tensor: int = 0,
    n_tensors: int = 1,
    leaf: str | None = None,
) -> str:
    """The HDF5 path of one captured tensor.

    `/captures/<layer>/<site>`; a module with several floating-point tensors at a site gets
    `_<i>` per tensor, a structured output (dict, namedtuple, ModelOutput) `.<key>` per leaf
    (`leaf` is that suffix, engine/leaves.py), and every call of a module after its first in
    one forward pass gets `.call<k>` (ResNet blocks call their one ReLU twice).
    """
    site = getattr(site, "value", site)
    part = leaf if leaf is not None else (f"_{tensor}" if n_tensors > 1 else "")
    name = f"{site}{part}" + (f".call{call}" if call else "")
    return f"captures/{layer}/{name}"


def derived_key(method: str, layer: str) -> str:
    """The HDF5 path of one derived result."""
    return f"derived/{method}/{layer}"


GAP_SUFFIX = ".completeness_gap"


def gap_key(method: str, layer: str) -> str:
    """The path of a result's completeness gap (N,): Σ attributions − (f(x) − f(baseline))."""
    return f"{derived_key(method, layer)}{GAP_SUFFIX}"


# Dataset attributes of captures not stored one row per sample (engine/probe.py): a tensor
# with no batch axis has one row per batch of PER_BATCH samples (the last may be shorter);
# one with k rows per sample folded into the batch axis is stored (N, k, ...), FOLDED = k.
PER_BATCH = "per_batch"
FOLDED = "folded_rows"


def per_batch(ds: h5py.Dataset) -> int:
    """The batch size of a dataset stored one row per batch; 0 for one row per sample."""
    return int(ds.attrs.get(PER_BATCH, 0))


def rows_for(ds: h5py.Dataset, completed: int) -> int:
    """The rows `ds` holds once `completed` samples are: one per sample, or one per batch."""
    size = per_batch(ds)
    return -(-completed // size) if size else completed


def rows_note(ds: h5py.Dataset) -> str:
    """How a dataset's rows map to samples, when not one row per sample ('' otherwise)."""
    if per_batch(ds):
        return f"one row per batch of {per_batch(ds)} samples (no batch axis)"
    fold = int(ds.attrs.get(FOLDED, 0))
    return f"axis 1: the {fold} rows per sample folded into the batch axis" if fold else ""


def copy_attrs(src: h5py.HLObject, dst: h5py.HLObject) -> None:
    """A file's or dataset's attributes onto its copy (a resumed file, the torchrun join),
    less the dimension-scale ones: they hold references into `src`'s file, and the copy gets
    its own scales (io/dimensions.py)."""
    for name, value in src.attrs.items():
        if name not in SCALE_ATTRS:
            dst.attrs[name] = value


def path_rows(paths: list[str], width: int) -> np.ndarray:
    """Rows of /samples/path: UTF-8 of `width` bytes each. One width for the whole run,
    from every file it reads, so resumed rows and torchrun shards share one dtype (HDF5
    virtual datasets cannot hold variable-length strings). A file name that is not UTF-8
    keeps its bytes (os.fsencode), and `read_paths` gives back the same str."""
    return np.array([os.fsencode(p) for p in paths], dtype=h5py.string_dtype("utf-8", width))


def read_paths(f: h5py.File) -> list[str] | None:
    """The source file of each complete row, or None for a dataset not read from files."""
    if SAMPLES_PATH not in f:
        return None
    rows = f[SAMPLES_PATH].asstr(errors="surrogateescape")[: _state(f).completed]
    return [str(p) for p in rows]


# The model input's pseudo-layer: the batch itself, and the input gradient.
INPUT_PHOTO = capture_key("input", "output")
INPUT_GRAD = capture_key("input", "grad_output")


@dataclass(frozen=True)
class Provenance:
    """The root attributes that say where the numbers came from (written once, at creation)."""

    config: str  # the resolved config, YAML
    experiment: str
    hookrun_version: str
    hookrun_git_commit: str
    torch_version: str
    torchvision_version: str
    h5py_version: str
    seed: int
    weights_file: str
    weights_sha256: str
    device: str
    hostname: str
    world_size: int
    # sha256 over the source files' (path, size, label), for file datasets ("" otherwise)
    data_files_sha256: str = ""
    # Modules a glob/type/regex selector matched that never ran: "hook: a, b; hook2: c".
    never_ran: str = ""
    # Files read during the run (the `patch` action), JSON {hook: {file, sha256}}; "" if none.
    patch_sources: str = ""


@dataclass(frozen=True)
class FileState:
    """What a captures.h5 says about itself."""

    status: str | None
    completed: int
    config: str | None
    experiment: str
    error: str
    never_ran: str = ""


def _state(f: h5py.File) -> FileState:
    attrs = f.attrs
    config = attrs.get("config")
    status = attrs.get("status")
    return FileState(
        status=None if status is None else str(status),
        completed=int(attrs.get("completed", 0)),
        config=None if config is None else str(config),
        experiment=str(attrs.get("experiment", "")),
        error=str(attrs.get("error", "")),
        never_ran=str(attrs.get("never_ran", "")),
    )


def read_state(source: Path | h5py.File) -> FileState:
    """The status, rows, config and experiment a file records (an open file, or a path);
    OSError naming the damage when rows it counts as complete are not in the file."""
    if isinstance(source, h5py.File):
        return _state(source)
    with open_readonly(source) as f:
        state = _state(f)
        size = Path(source).stat().st_size
        for ds in (f[name] for name in dataset_names(f)):
            reason = storage.missing_rows([ds], rows_for(ds, state.completed), size)
            if reason:
                raise OSError(reason)
    return state


def read_provenance(path: Path) -> dict[str, str]:
    """The provenance attributes a file records, as text (absent ones left out)."""
    names = [field.name for field in dataclasses.fields(Provenance)]
    with open_readonly(path) as f:
        return {n: str(f.attrs[n]) for n in names if n in f.attrs}


def captures_of(f: h5py.File) -> dict[str, dict[str, h5py.Dataset]]:
    """Every captured layer → its sites → dataset. A function call site's layer holds a
    slash (`block/gelu.0`), so layers are the groups that hold datasets, at any depth."""
    out: dict[str, dict[str, h5py.Dataset]] = {}
    group = f.get("captures")
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
    group = f.get("derived", {})
    return {
        method: {k: ds for k, ds in g.items() if not is_dimension(ds)}
        for method, g in group.items()
    }


def dataset_names(f: h5py.File) -> list[str]:
    """Every data-holding dataset's path in the file (rows of samples or batches; not the
    empty datasets that only name a dimension)."""
    names: list[str] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and not is_dimension(obj):
            names.append(name)

    f.visititems(visit)
    return names


def write_header(f: h5py.File, header: Provenance | Mapping[str, Any]) -> None:
    """The provenance attributes (or any mapping of them) onto a new file."""
    items = dataclasses.asdict(header) if isinstance(header, Provenance) else header
    for key, value in items.items():
        f.attrs[key] = value


def mark_status(f: h5py.File, status: str, error: str = "") -> None:
    """The file's `status` (running, complete, failed, interrupted) and its `error`."""
    f.attrs["error"] = error
    f.attrs["status"] = status


def mark_completed(f: h5py.File, rows: int) -> None:
    """`completed`: the rows written; set only once they are flushed, never ahead of them."""
    f.attrs["completed"] = rows


def mark_rows(ds: h5py.Dataset, fold: int, batch_size: int) -> None:
    """Say how a new dataset's rows map to samples (`fold` as in FOLDED; 0: one row per
    batch of `batch_size`); set before SWMR starts, which allows no new attributes."""
    if fold != 1:
        ds.attrs[PER_BATCH if fold == 0 else FOLDED] = batch_size if fold == 0 else fold


def mark_complete(f: h5py.File, rows: int) -> None:
    """The final attributes of a file written whole in one go (the torchrun join)."""
    f.attrs["error"] = ""
    mark_completed(f, rows)
    f.attrs["status"] = "complete"


# Named dimensions (HDF5 dimension scales, netCDF-4's convention: xarray, netCDF tools and
# HDFView read them). Per-sample rows are SAMPLE, one dimension for the file whose coordinate
# is /sample (the dataset indices); rows once per batch are BATCH; k rows per sample folded
# add FOLD. AXES names the other axes by path (the first fnmatch pattern that matches; `*`
# crosses `/`): `{layout}` is what the probe found of a capture (LAYOUT_AXES), `{input}` the
# model input's axes; an axis nothing names is `dim_<k>`.
SAMPLE = "sample"
BATCH = "batch"
FOLD = "fold"
AXES: dict[str, str] = {
    SAMPLE: SAMPLE,
    "samples/tokens": "sample token",
    "samples/mask": "sample token",
    "samples/*": "sample",
    "model/output": "sample class",
    "captures/*": "sample {layout}",
    "derived/*/*.completeness_gap": "sample",
    "derived/*/input": "sample {input}",
    "derived/guided_grad_cam/*": "sample {input}",
    "derived/*/*": "sample y x",
}
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
    words: list[str] = []
    for word in rule.split():
        if word == "{layout}":
            words += facts.tensors.get(path, ("?",))
        elif word == "{input}":
            words += facts.input or ("?",)
        else:
            words.append(word)
    rows = words[:1] if words[:1] == [SAMPLE] else []
    if rows and per_batch(ds):
        rows = [BATCH]
    elif rows and int(ds.attrs.get(FOLDED, 0)):
        rows.append(FOLD)
    rest = words[1:] if rows else words
    if len(rows) + len(rest) != len(ds.shape) or "?" in rest:
        rest = [f"dim_{k}" for k in range(len(rows), len(ds.shape))]
    return (*rows, *rest)


# A dimension with no values of its own is an empty dataset marked as a scale, whose NAME
# starts with netCDF's sentence (h5netcdf and netCDF-C skip such datasets as variables).
NOT_A_VARIABLE = "This is a netCDF dimension but not a netCDF variable."
# Attributes the HDF5 dimension-scale API writes (references into their own file).
SCALE_ATTRS = ("CLASS", "NAME", "REFERENCE_LIST", "DIMENSION_LIST", "DIMENSION_LABELS")


def is_dimension(ds: h5py.Dataset) -> bool:
    """Whether `ds` only names a dimension (holds no data)."""
    return NOT_A_VARIABLE in str(ds.attrs.get("NAME", ""))  # bytes or str, as written
