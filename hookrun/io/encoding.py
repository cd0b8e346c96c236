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

__all__ = ["host_array", "bits_to_float32", "Decoded", "decoded", "read_floats", "path_rows"]


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
    """A bfloat16 dataset seen as the float32 numbers it holds: indexing, `np.asarray`,
    iteration and `astype` decode its bits; everything else (shape, attrs, name, chunks,
    file) is the h5py dataset's, and `raw` is the dataset itself (its uint16 words)."""

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

    def __iter__(self) -> Iterator[np.ndarray]:
        for row in self.raw:
            yield bits_to_float32(row)

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

    def __len__(self) -> int:
        return len(self.values)


def decoded(ds: h5py.Dataset) -> h5py.Dataset | Decoded:
    """`ds` as the numbers it holds: a bfloat16 dataset decoded, any other as it is."""
    return Decoded(ds) if isinstance(ds, h5py.Dataset) and is_bfloat16(ds) else ds


def read_floats(ds: h5py.Dataset | Decoded, rows: Any = ()) -> np.ndarray:
    """`ds[rows]` as numbers (a bfloat16 dataset's bits decoded)."""
    return decoded(ds)[rows]


def path_rows(paths: list[str], width: int) -> np.ndarray:
    """Rows of the source-path dataset: UTF-8 of `width` bytes each. One width for the run,
    from every file it reads, so resumed rows and torchrun shards share one dtype (HDF5
    virtual datasets cannot hold variable-length strings). A file name that is not UTF-8
    keeps its bytes (os.fsencode), and `layout.read_paths` gives back the same str."""
    return np.array([os.fsencode(p) for p in paths], dtype=h5py.string_dtype("utf-8", width))
