"""How values HDF5 cannot hold as they are reach the file: bfloat16 floats as their raw bits,
source paths as fixed-width UTF-8 — and how they read back exactly.

Every read of a hookrun file's numbers inside hookrun goes through `decoded` / `read_floats`
(patch sources, `hookrun.open(...)[key]`, the xarray view, the pictures, the summary, the
sweep's ranking): a bfloat16 dataset's uint16 words read as numbers would be wrong by orders
of magnitude, without a word."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np
import torch

from hookrun.io.layout import is_bfloat16

__all__ = [
    "host_array",
    "bits_to_float32",
    "Decoded",
    "DecodedGroup",
    "DecodedFile",
    "decoded",
    "decoded_node",
    "read_floats",
    "path_rows",
]


def host_array(value: Any, bfloat16: bool) -> np.ndarray:
    """A record as numpy; with sink.dtype=bfloat16 floats become their bfloat16 bits (uint16),
    which numpy and h5py can hold (the dataset is marked: layout.mark_bfloat16)."""
    if isinstance(value, torch.Tensor):
        if bfloat16 and value.is_floating_point():
            return value.to(torch.bfloat16).view(torch.uint16).numpy()
        return value.numpy()
    array = np.asarray(value)
    if bfloat16 and np.issubdtype(array.dtype, np.floating):
        return torch.from_numpy(array).to(torch.bfloat16).view(torch.uint16).numpy()
    return array


def bits_to_float32(bits: Any) -> np.ndarray:
    """bfloat16 bits (uint16) as the float32 values they are (exact: a bfloat16 is the high
    half of a float32)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


class Decoded:
    """A bfloat16 dataset seen as the float32 numbers it holds: whatever on h5py's dataset
    gives values or their size gives the decoded float32 ones (indexing, `np.asarray`,
    iteration, `astype`, `read_direct`, `dtype`, `nbytes`, `fillvalue`); `parent` and `file`
    decode what is reached through them (DecodedGroup, DecodedFile); everything else (shape,
    size, attrs, name, chunks, dims) is the h5py dataset's, and `raw` is the dataset itself
    (its uint16 words)."""

    dtype = np.dtype(np.float32)

    def __init__(self, ds: h5py.Dataset) -> None:
        self.raw = ds

    def __getitem__(self, key: Any) -> np.ndarray:
        return bits_to_float32(self.raw[key])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self[()]
        return values if dtype is None else values.astype(dtype)

    def __len__(self) -> int:
        return len(self.raw)

    def __bool__(self) -> bool:  # as h5py's: an open dataset is true, rows or none
        return bool(self.raw)

    def __iter__(self) -> Iterator[np.ndarray]:
        for row in self.raw:
            yield bits_to_float32(row)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Decoded) and self.raw == other.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    @property
    def nbytes(self) -> int:
        """The bytes the decoded values take (float32), as h5py's size * itemsize."""
        return self.raw.size * self.dtype.itemsize

    @property
    def fillvalue(self) -> np.float32:
        return bits_to_float32(np.uint16(self.raw.fillvalue))[()]

    @property
    def parent(self) -> DecodedGroup:
        return decoded_node(self.raw.parent)

    @property
    def file(self) -> DecodedFile:
        return DecodedFile(self.raw.file.id)

    def read_direct(self, dest: np.ndarray, source_sel: Any = None, dest_sel: Any = None) -> None:
        """As h5py's: the values of `source_sel` (numpy.s_[...], all by default) into
        `dest[dest_sel]`, converted to dest's dtype; decoded, not the words."""
        dest[() if dest_sel is None else dest_sel] = self[() if source_sel is None else source_sel]

    def astype(self, dtype: Any) -> _Cast:
        """As h5py's `ds.astype(dtype)[rows]`: the decoded values in another dtype."""
        return _Cast(self, np.dtype(dtype))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def __repr__(self) -> str:
        return f"<bfloat16 dataset {self.raw.name!r}: shape {self.raw.shape}, read as float32>"


class _Cast:
    def __init__(self, values: Decoded, dtype: np.dtype) -> None:
        self.values, self.dtype = values, dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        return self.values[key].astype(self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self[()]
        return values if dtype is None else values.astype(dtype)

    def __len__(self) -> int:
        return len(self.values)


class _Decodes:
    """What DecodedGroup and DecodedFile add to h5py's group and file: every object reached
    from them (indexing by name or path, `get`, `values`, `items`, `visititems`, `parent`,
    `file`) is decoded_node's, so no route to a bfloat16 dataset gives its words."""

    def __getitem__(self, name: Any) -> Any:
        return decoded_node(super().__getitem__(name))  # type: ignore[misc]

    def get(
        self,
        name: Any,
        default: Any = None,
        getclass: bool = False,
        getlink: bool = False,
        **kw: Any,
    ) -> Any:
        found = super().get(name, default, getclass, getlink, **kw)  # type: ignore[misc]
        return found if getclass or getlink or found is default else decoded_node(found)

    @property
    def file(self) -> DecodedFile:
        return DecodedFile(super().file.id)  # type: ignore[misc]


class DecodedGroup(_Decodes, h5py.Group):
    """An h5py group (it is one: isinstance, names, attrs, iteration are h5py's) whose
    bfloat16 datasets, at any depth and by any route, read as the numbers they hold."""

    def __repr__(self) -> str:
        return super().__repr__().replace("<HDF5 group", "<HDF5 group (bfloat16 decoded)", 1)


class DecodedFile(_Decodes, h5py.File):
    """The h5py file of a DecodedGroup or Decoded (`.file`), decoding as they do."""


def decoded(ds: h5py.Dataset) -> h5py.Dataset | Decoded:
    """`ds` as the numbers it holds: a bfloat16 dataset decoded, any other as it is."""
    return Decoded(ds) if isinstance(ds, h5py.Dataset) and is_bfloat16(ds) else ds


def decoded_node(obj: Any) -> Any:
    """Any object of a file as a reader should see it: a dataset as `decoded` gives it, a
    group or file as DecodedGroup / DecodedFile, anything else (a named type) as it is."""
    if isinstance(obj, h5py.File):
        return DecodedFile(obj.id)
    if isinstance(obj, h5py.Group):
        return DecodedGroup(obj.id)
    return decoded(obj)


def read_floats(ds: h5py.Dataset | Decoded, rows: Any = ()) -> np.ndarray:
    """`ds[rows]` as numbers (a bfloat16 dataset's bits decoded)."""
    return decoded(ds)[rows]


def path_rows(paths: list[str], width: int) -> np.ndarray:
    """Rows of the source-path dataset: UTF-8 of `width` bytes each. One width for the run,
    from every file it reads, so resumed rows and torchrun shards share one dtype (HDF5
    virtual datasets cannot hold variable-length strings). A file name that is not UTF-8
    keeps its bytes (os.fsencode), and `layout.read_paths` gives back the same str."""
    return np.array([os.fsencode(p) for p in paths], dtype=h5py.string_dtype("utf-8", width))
