"""How values HDF5 cannot hold as they are reach the file: bfloat16 floats as their raw bits,
source paths as fixed-width UTF-8 — and how they read back exactly."""

from __future__ import annotations

import os
from typing import Any

import h5py
import numpy as np
import torch

from hookrun.io.layout import is_bfloat16

__all__ = ["host_array", "read_floats", "path_rows"]


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


def read_floats(ds: h5py.Dataset, rows: Any = ()) -> np.ndarray:
    """`ds[rows]` as numbers: a bfloat16 dataset's bits as the float32 values they are
    (exact: a bfloat16 is the high half of a float32)."""
    data = ds[rows]
    if is_bfloat16(ds):
        return (np.asarray(data).astype(np.uint32) << 16).view(np.float32)
    return data


def path_rows(paths: list[str], width: int) -> np.ndarray:
    """Rows of the source-path dataset: UTF-8 of `width` bytes each. One width for the run,
    from every file it reads, so resumed rows and torchrun shards share one dtype (HDF5
    virtual datasets cannot hold variable-length strings). A file name that is not UTF-8
    keeps its bytes (os.fsencode), and `layout.read_paths` gives back the same str."""
    return np.array([os.fsencode(p) for p in paths], dtype=h5py.string_dtype("utf-8", width))
