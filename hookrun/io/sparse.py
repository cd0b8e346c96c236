"""Sparse records: a batch of mostly-zero rows (SAE latents: ~32 of 16k non-zero per token)
as its non-zeros only, and back.

A batch of n rows whose dense per-sample shape is (*lead, width) — (T, d_sae), or (d_sae,)
at one position — is `SparseRows(counts, values, latent)`: `counts` (n, *lead) int32, the
non-zeros of each row's each token; `values` (nnz,), the non-zeros in row-major order;
`latent` (nnz,) int32, their index along the last axis. No offsets: row i's entries start at
sum(counts[:i]), which is what lets a file append, truncate (resume) and concatenate (the
torchrun join) them as plain 1-D datasets (io/layout.py names the parts in the file).

What counts as a non-zero is `value != 0`: NaN is kept (NaN != 0), and -0.0 is a zero (it
reads back as +0.0, equal under ==, not bitwise). `densify(sparsify(x))` equals `x` under
numpy's `array_equal(..., equal_nan=True)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from hookrun.io.encoding import bits_to_float32, host_array

__all__ = [
    "SparseRows",
    "SparseSpec",
    "sparsify",
    "densify",
    "host_rows",
    "check_rows",
    "decode_values",
]


class SparseSpec(NamedTuple):
    """What a file needs to know of a sparse record before its first batch: the dense
    per-sample `shape` (e.g. (T, d_sae)) and the names of its axes, the sample axis first
    (e.g. ("sample", "token", "latent")). A plain (shape, dims) tuple is one too."""

    shape: tuple[int, ...]
    dims: tuple[str, ...]


@dataclass
class SparseRows:
    """A batch of rows stored by their non-zeros (torch tensors or numpy arrays).

    Attributes:
        counts: (n, *lead) int32: the non-zeros of each row's each token.
        values: (nnz,): the non-zero values, in row-major order.
        latent: (nnz,) int32: each value's index along the dense last axis.
    """

    counts: Any
    values: Any
    latent: Any

    def __len__(self) -> int:
        """The rows of the batch (what the appender counts as its rows)."""
        return len(self.counts)

    @property
    def nnz(self) -> int:
        """The entries (non-zeros) of the batch."""
        return len(self.values)


def sparsify(dense: torch.Tensor) -> SparseRows:
    """A dense batch (n, *lead, width) as its non-zeros, on the tensor's own device.

    One host synchronisation, the one `nonzero` needs to size its result; nothing dense is
    copied to the host.

    Args:
        dense: A floating-point tensor of at least two axes (rows, ..., width).

    Returns:
        SparseRows of torch tensors on `dense`'s device, values in `dense`'s dtype.

    Raises:
        ValueError: `dense` has fewer than two axes.
    """
    if dense.ndim < 2:
        raise ValueError(f"sparsify: shape {tuple(dense.shape)}; valid: (rows, ..., width)")
    width = dense.shape[-1]
    # nonzero of the values themselves (NaN != 0: kept; -0.0 == 0: a zero), not of a mask:
    # a batch of 32 × 128 tokens at d_sae 16384 is 6.7e7 values, and a mask made, summed
    # and searched was three more passes over them (0.65 s against 0.42 s a batch on 2
    # cores, tests/benchmarks/sae.py). Flat indices are row-major: entries row by row.
    flat = dense.reshape(-1).nonzero().squeeze(1)
    values = dense.reshape(-1).index_select(0, flat)
    latent = (flat % width).to(torch.int32)
    # Each token's entries end where its first flat index past it would sit: a search over
    # the few non-zeros, on the device, with no second host synchronisation.
    tokens = math.prod(dense.shape[:-1])
    edges = torch.arange(tokens + 1, device=dense.device, dtype=flat.dtype) * width
    ends = torch.searchsorted(flat, edges)
    counts = ends.diff().to(torch.int32).reshape(dense.shape[:-1])
    return SparseRows(counts, values, latent)


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: its values, exactly
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def check_rows(rows: SparseRows, width: int, key: str = "sparse record") -> None:
    """Refuse rows whose parts disagree: entries not what the counts sum to, a latent
    index outside [0, width), a count outside [0, width).

    Raises:
        ValueError: naming `key` and what disagrees.
    """
    counts, latent = _numpy(rows.counts), _numpy(rows.latent)
    total = int(counts.sum(dtype=np.int64))
    if total != len(rows.values) or total != len(latent):
        raise ValueError(
            f"{key}: counts sum to {total} entries, values hold {len(rows.values)}, latent "
            f"{len(latent)}; valid: all three equal"
        )
    if counts.size and (counts.min() < 0 or counts.max() > width):
        raise ValueError(f"{key}: a count outside [0, {width}]")
    if latent.size and (latent.min() < 0 or latent.max() >= width):
        raise ValueError(f"{key}: a latent index outside [0, {width})")


def densify(rows: SparseRows, width: int) -> np.ndarray:
    """The dense batch (n, *lead, width) of sparse rows: their values, zeros elsewhere.

    Args:
        rows: SparseRows of torch tensors or numpy arrays (bfloat16 values read as float32).
        width: The dense last axis (d_sae).

    Returns:
        A numpy array in the values' dtype (float32 for bfloat16).

    Raises:
        ValueError: The parts disagree (check_rows).
    """
    check_rows(rows, width)
    counts, values, latent = _numpy(rows.counts), _numpy(rows.values), _numpy(rows.latent)
    tokens = math.prod(counts.shape)
    out = np.zeros((tokens, width), dtype=values.dtype)
    token = np.repeat(np.arange(tokens), counts.reshape(-1).astype(np.int64))
    out[token, latent] = values
    return out.reshape(*counts.shape, width)


def host_rows(rows: SparseRows, bfloat16: bool) -> SparseRows:
    """Sparse rows as the file stores them: numpy, counts and latent int32, values as
    io/encoding.py's `host_array` makes any float (bfloat16 as its raw bits, uint16)."""
    counts = _numpy(rows.counts).astype(np.int32, copy=False)
    latent = _numpy(rows.latent).astype(np.int32, copy=False)
    values = rows.values
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype == torch.bfloat16 and not bfloat16:  # numpy holds no bfloat16
            values = values.float()
    return SparseRows(counts, host_array(values, bfloat16), latent)


def decode_values(values: np.ndarray, bfloat16: bool) -> np.ndarray:
    """Stored values as float32 (bfloat16 bits decoded)."""
    return bits_to_float32(values) if bfloat16 else np.asarray(values, dtype=np.float32)
