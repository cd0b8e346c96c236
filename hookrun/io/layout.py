"""The captures.h5 layout — the one module that spells its paths and attributes.

| path | shape | meaning |
|---|---|---|
| /captures/<layer>/<site>[_<i>][.call<k>] | (N, ...) | one row per sample, in dataset order |
| /samples/index, /samples/label, /samples/target | (N,) int64 | dataset index, label, target |
| /samples/path | (N,) UTF-8, fixed width | source file of each row (file datasets) |
| /model/output | (N, ...) | the model's output |
| /derived/<method>/<layer> | (N, ...) | raw derived results |
| /derived/<method>/<layer>.completeness_gap | (N,) | Σ attributions − (f(x) − f(baseline)) |

Root attributes: the provenance fields below, then `error`, `status` (running → complete |
failed | interrupted) and `completed` (rows written *and flushed*, never ahead of the data).

Crash safety: SWMR mode once the first batch's datasets exist, a flush every batch; a killed
writer's file opens read-only (`open_readonly`) with every row up to `completed` intact, and
io/stored.py copies them into a fresh file (HDF5 cannot clear a dead writer's mark).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.io import storage
from hookrun.io.storage import CHUNK_BYTES, chunk_shape

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
    "FileOptions",
    "CapturesFile",
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
    "mark_complete",
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


@dataclass(frozen=True)
class FileOptions:
    """How new datasets are stored: float dtype, compression, the rows expected (which
    keeps a small run from allocating a whole 1 MiB chunk per dataset), and HDF5's
    fletcher32 checksum on every chunk (a damaged chunk then fails loudly on read)."""

    dtype: str = "float32"
    compression: str | None = None
    expected_rows: int | None = None
    checksum: bool = True


def open_readonly(path: Path) -> h5py.File:
    """Open a captures.h5 for reading, also one whose writer was killed mid-run; OSError
    with the reason for a cut or damaged file."""
    try:
        return h5py.File(path, "r")
    except OSError:
        reason = storage.cut_short(Path(path))  # SWMR reading skips HDF5's own EOF check
        if reason:
            raise OSError(reason) from None
        return h5py.File(path, "r", swmr=True)  # still marked open by a killed SWMR writer


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
        datasets = [f[name] for name in dataset_names(f)]
        reason = storage.missing_rows(datasets, state.completed, Path(source).stat().st_size)
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
        if isinstance(obj, h5py.Dataset):
            layer, site = name.rsplit("/", 1)
            out.setdefault(layer, {})[site] = obj

    group.visititems(visit)
    return out


def derived_of(f: h5py.File) -> dict[str, dict[str, h5py.Dataset]]:
    """Every derived method → its layers → dataset."""
    group = f.get("derived", {})
    return {method: dict(g.items()) for method, g in group.items()}


def dataset_names(f: h5py.File) -> list[str]:
    """Every dataset's path in the file."""
    names: list[str] = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return names


def write_header(f: h5py.File, header: Provenance | Mapping[str, Any]) -> None:
    """The provenance attributes (or any mapping of them) onto a new file."""
    items = dataclasses.asdict(header) if isinstance(header, Provenance) else header
    for key, value in items.items():
        f.attrs[key] = value


class CapturesFile:
    """A captures.h5 open for appending rows, batch by batch (one writer thread at a time).

    `create` makes a new file with every attribute up front (SWMR forbids new attributes
    later); `reopen` continues an interrupted one from `completed`, dropping rows past it.
    `close(error)` sets the final status. Room for each batch is reserved before HDF5
    writes it (io/storage.py): a full disk then fails cleanly and the file still closes as
    `failed`; a write HDF5 itself failed leaves the file as it was after the last batch.
    """

    def __init__(self, file: h5py.File, options: FileOptions) -> None:
        self.file = file
        self.options = options
        self.rows = int(file.attrs["completed"])
        self.keys = set(dataset_names(file))
        self.broken = False  # HDF5 failed a write: the handle must not flush again

    @classmethod
    def create(
        cls,
        path: Path,
        header: Provenance | Mapping[str, Any],
        options: FileOptions,
        overwrite: bool = False,
    ) -> CapturesFile:
        # 'w-' refuses an existing file even if one appeared after the path was checked.
        f = h5py.File(path, "w" if overwrite else "w-", libver="latest")
        write_header(f, header)
        f.attrs["error"] = ""
        f.attrs["status"] = "running"
        f.attrs["completed"] = 0
        f.flush()
        return cls(f, options)

    @classmethod
    def reopen(cls, path: Path, options: FileOptions) -> CapturesFile:
        """Continue an interrupted, cleanly closed file (io/stored.py's `reopen` first
        copies a killed writer's file into one)."""
        f = h5py.File(path, "r+", libver="latest")
        out = cls(f, options)
        for key in out.keys:  # rows past `completed` may be half written: drop them
            f[key].resize(out.rows, axis=0)
        f.attrs["status"] = "running"
        f.attrs["error"] = ""
        f.flush()
        if out.keys:
            f.swmr_mode = True
        return out

    def append(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Write one batch (every key, same row count), then flush and advance `completed`."""
        if not self.keys:
            for key, array in arrays.items():
                self._create(key, array)
            self.file.swmr_mode = True  # all datasets exist: from here a kill loses nothing
        if set(arrays) != self.keys:
            raise RuntimeError(
                f"batch keys changed: missing {sorted(self.keys - set(arrays))}, "
                f"new {sorted(set(arrays) - self.keys)}"
            )
        n = {len(a) for a in arrays.values()}
        if len(n) != 1:
            raise RuntimeError(f"records of one batch differ in length: {n}")
        count = n.pop()
        datasets = [self.file[key] for key in arrays]
        storage.reserve(
            self.file, storage.batch_need(datasets, self.rows, count)
        )  # refused: HDF5 untouched
        try:
            for ds, array in zip(datasets, arrays.values(), strict=True):
                ds.resize(self.rows + count, axis=0)
                ds[self.rows : self.rows + count] = array
            self.file.flush()  # the data is on its way to disk before `completed` says so
            self.file.attrs["completed"] = self.rows + count
            self.file.flush()
        except (OSError, RuntimeError):
            self.broken = True
            raise
        self.rows += count

    def _create(self, key: str, array: np.ndarray) -> None:
        floating = np.issubdtype(array.dtype, np.floating)
        dtype = np.dtype(self.options.dtype) if floating else array.dtype
        if dtype.kind == "S":  # stored as UTF-8, not HDF5's default ASCII
            dtype = h5py.string_dtype("utf-8", dtype.itemsize)
        row = tuple(array.shape[1:])
        self.keys.add(key)
        self.file.create_dataset(
            key,
            shape=(0, *row),
            maxshape=(None, *row),
            chunks=chunk_shape(row, dtype.itemsize, self.options.expected_rows),
            dtype=dtype,
            compression=self.options.compression,
            fletcher32=self.options.checksum,
            track_times=False,  # same numbers → same bytes, whenever the run happened
        )

    def close(self, error: BaseException | None = None, interrupted: bool = False) -> None:
        """Final status (`complete`; `failed` or `interrupted` with the error recorded), then
        close. A broken handle is closed without writing: the file stays `running` with
        every row up to `completed` intact, which `resume=true` continues."""
        if self.broken:
            storage.abandon(self.file)
            return
        try:
            if error is None:
                self.file.attrs["status"] = "complete"
            else:
                self.file.attrs["status"] = "interrupted" if interrupted else "failed"
                self.file.attrs["error"] = f"{type(error).__name__}: {error}"
            path = Path(self.file.filename)
            self.file.close()
            storage.trim(path)
        except (OSError, RuntimeError):
            self.broken = True
            storage.abandon(self.file)
            raise


def mark_complete(f: h5py.File, rows: int) -> None:
    """The final attributes of a file written whole in one go (the torchrun join)."""
    f.attrs["error"] = ""
    f.attrs["completed"] = rows
    f.attrs["status"] = "complete"
