"""The captures.h5 layout — the one module that spells its paths and attributes.

| path | shape | meaning |
|---|---|---|
| /captures/<layer>/<site>[_<i>][.call<k>] | (N, ...) | one row per sample, in dataset order |
| /samples/index, /samples/label, /samples/target | (N,) int64 | dataset index, label, target |
| /model/output | (N, ...) | the model's output |
| /derived/<method>/<layer> | (N, ...) | raw derived results |

Root attributes: the provenance fields below, then `error`, `status` (running → complete |
failed | interrupted) and `completed` (rows written *and flushed*, never ahead of the data).

Crash safety: datasets are created from the first batch, then the file switches to HDF5's
SWMR mode (single writer, multiple readers) and is flushed after every batch; a writer
killed at any moment leaves a file that opens read-only (with `swmr=True`, as
`open_readonly` does) with every row up to `completed` intact. HDF5 then still marks the
file as open for writing; `rewrite_rows` copies those rows into a fresh file that replaces
it (HDF5 has no public call to clear that mark).

The sink (io/sink.py), the reader (io/results.py), derived methods, render, resume and the
torchrun join all go through the functions here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

__all__ = [
    "CHUNK_BYTES",
    "SAMPLES_INDEX",
    "SAMPLES_LABEL",
    "SAMPLES_TARGET",
    "MODEL_OUTPUT",
    "INPUT_PHOTO",
    "INPUT_GRAD",
    "Provenance",
    "FileState",
    "FileOptions",
    "CapturesFile",
    "capture_key",
    "derived_key",
    "chunk_shape",
    "open_readonly",
    "read_state",
    "captures_of",
    "derived_of",
    "rewrite_rows",
    "join_shards",
]

SAMPLES_INDEX = "samples/index"
SAMPLES_LABEL = "samples/label"
SAMPLES_TARGET = "samples/target"
MODEL_OUTPUT = "model/output"

# Chunks of about 1 MiB along the sample axis: large enough for fast appends, small
# enough that reading a few rows does not pull in much more than asked.
CHUNK_BYTES = 1 << 20


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
    # Modules a glob/type/regex selector matched that never ran: "hook: a, b; hook2: c".
    never_ran: str = ""


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
    """How new datasets are stored: float dtype, compression, and the rows expected (which
    keeps a small run from allocating a whole 1 MiB chunk per dataset)."""

    dtype: str = "float32"
    compression: str | None = None
    expected_rows: int | None = None


def chunk_shape(
    row_shape: tuple[int, ...], itemsize: int, max_rows: int | None = None
) -> tuple[int, ...]:
    """A chunk of ~CHUNK_BYTES: whole rows when a row is smaller, else a slab of one row."""
    row_bytes = max(1, math.prod(row_shape) * itemsize)
    if row_bytes <= CHUNK_BYTES:
        rows = max(1, CHUNK_BYTES // row_bytes)
        return (min(rows, max_rows) if max_rows else rows, *row_shape)
    chunk = [1, *row_shape]
    # Split the leading axes of a large row until the chunk fits (e.g. (1, 16, 112, 112)),
    # into equal parts so the last chunk along an axis is not mostly padding.
    for axis in range(1, len(chunk)):
        inner = math.prod(chunk[axis + 1 :]) * itemsize
        fits = max(1, CHUNK_BYTES // max(1, inner))
        parts = math.ceil(chunk[axis] / fits)
        chunk[axis] = math.ceil(chunk[axis] / parts)
        if math.prod(chunk) * itemsize <= CHUNK_BYTES:
            break
    return tuple(chunk)


def open_readonly(path: Path) -> h5py.File:
    """Open a captures.h5 for reading, also one whose writer was killed mid-run."""
    try:
        return h5py.File(path, "r")
    except OSError:
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
    """The status, rows, config and experiment a file records (an open file, or a path)."""
    if isinstance(source, h5py.File):
        return _state(source)
    with open_readonly(source) as f:
        return _state(f)


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


def _datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return names


def _write_header(f: h5py.File, header: Provenance | Mapping[str, Any]) -> None:
    items = dataclasses.asdict(header) if isinstance(header, Provenance) else header
    for key, value in items.items():
        f.attrs[key] = value


class CapturesFile:
    """A captures.h5 open for appending rows, batch by batch (one writer thread at a time).

    `create` makes a new file with every attribute up front (SWMR forbids new attributes
    later); `reopen` continues an interrupted one from `completed`, dropping rows past it.
    `close(error)` sets the final status.
    """

    def __init__(self, file: h5py.File, options: FileOptions) -> None:
        self.file = file
        self.options = options
        self.rows = int(file.attrs["completed"])
        self.keys = set(_datasets(file))

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
        _write_header(f, header)
        f.attrs["error"] = ""
        f.attrs["status"] = "running"
        f.attrs["completed"] = 0
        f.flush()
        return cls(f, options)

    @classmethod
    def reopen(cls, path: Path, options: FileOptions) -> CapturesFile:
        try:
            f = h5py.File(path, "r+", libver="latest")
        except OSError:  # the writer was killed: HDF5 still marks the file open for writing
            rewrite_rows(path)
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
        for key, array in arrays.items():
            ds = self.file[key]
            ds.resize(self.rows + count, axis=0)
            ds[self.rows : self.rows + count] = array
        self.file.flush()  # the data is on its way to disk before `completed` says so
        self.rows += count
        self.file.attrs["completed"] = self.rows
        self.file.flush()

    def _create(self, key: str, array: np.ndarray) -> None:
        floating = np.issubdtype(array.dtype, np.floating)
        dtype = np.dtype(self.options.dtype) if floating else array.dtype
        row = tuple(array.shape[1:])
        self.keys.add(key)
        self.file.create_dataset(
            key,
            shape=(0, *row),
            maxshape=(None, *row),
            chunks=chunk_shape(row, dtype.itemsize, self.options.expected_rows),
            dtype=dtype,
            compression=self.options.compression,
            track_times=False,  # same numbers → same bytes, whenever the run happened
        )

    def close(self, error: BaseException | None = None) -> None:
        """Final status (`complete`, or `failed` with the error recorded), then close."""
        self.file.attrs["status"] = "complete" if error is None else "failed"
        if error is not None:
            self.file.attrs["error"] = f"{type(error).__name__}: {error}"
        self.file.close()


def rewrite_rows(path: Path) -> None:
    """Replace a killed writer's file by a closed copy of its attributes and its rows up to
    `completed`, keeping every dataset's dtype, chunks and compression."""
    fresh = path.with_name(f".{path.name}.resume")
    with open_readonly(path) as src, h5py.File(fresh, "w", libver="latest") as dst:
        rows = int(src.attrs["completed"])
        _write_header(dst, dict(src.attrs.items()))
        for key in _datasets(src):
            ds = src[key]
            out = dst.create_dataset(
                key,
                shape=(rows, *ds.shape[1:]),
                maxshape=ds.maxshape,
                chunks=ds.chunks,
                dtype=ds.dtype,
                compression=ds.compression,
                compression_opts=ds.compression_opts,
                track_times=False,
            )
            step = max(1, ds.chunks[0])
            for start in range(0, rows, step):
                out[start : start + step] = ds[start : min(rows, start + step)]
    fresh.replace(path)  # atomic: the old file stays whole until the copy is


def join_shards(
    path: Path,
    shards: list[Path],
    samples: int,
    header: Provenance | Mapping[str, Any],
    replace: bool = False,
) -> None:
    """Write `path` as virtual datasets over complete shard files, in the given order; an
    existing `path` only with `replace`. Raises ValueError naming an incomplete shard."""
    opened = [h5py.File(s, "r") for s in shards]
    try:
        for shard, f in zip(shards, opened, strict=True):
            if f.attrs.get("status") != "complete":
                raise ValueError(f"the shard {shard} is not complete")
        with h5py.File(path, "w" if replace else "w-", libver="latest") as out:
            _write_header(out, header)
            for key in _datasets(opened[0]):
                first = opened[0][key]
                virtual = h5py.VirtualLayout(shape=(samples, *first.shape[1:]), dtype=first.dtype)
                offset = 0
                for shard, f in zip(shards, opened, strict=True):
                    rows = f[key].shape[0]
                    # A bare file name: HDF5 finds the shard next to captures.h5 wherever
                    # the run directory is moved.
                    virtual[offset : offset + rows] = h5py.VirtualSource(
                        shard.name, key, shape=f[key].shape
                    )
                    offset += rows
                out.create_virtual_dataset(key, virtual)
            out.attrs["error"] = ""
            out.attrs["completed"] = samples
            out.attrs["status"] = "complete"
    finally:
        for f in opened:
            f.close()
