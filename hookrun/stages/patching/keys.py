"""Where the patching grid's datasets are in captures.h5: /patching/<site kind> (N, layers,
positions; heads: N, layers, heads, positions) with its modules and positions as attributes,
<kind>_logit_diff, the approximations <kind>_atp, <kind>_atp_ig (and their _error against
the exact grid), and the runs' logit differences /patching/clean and /patching/corrupted
(N,); the /patching group's attribute `unscorable`."""

from __future__ import annotations

import h5py
import numpy as np

from hookrun.io import layout

__all__ = [
    "PATCHING",
    "PATCHING_CLEAN",
    "PATCHING_CORRUPTED",
    "LOGIT_DIFF_SUFFIX",
    "ERROR_SUFFIX",
    "UNSCORABLE",
    "patching_key",
    "CLEAN_TOLERANCE",
    "flat_rows",
    "mark_unscorable",
    "read_unscorable",
    "read_patching",
    "PEARSON",
    "SPEARMAN",
    "CELLS",
    "agreement",
]

PATCHING, PATCHING_CLEAN, PATCHING_CORRUPTED = "patching", "clean", "corrupted"
LOGIT_DIFF_SUFFIX = "_logit_diff"
# /patching/<kind>_<atp|atp_ig>: an approximation's scores; <kind>_<method>_error: minus the
# exact grid's (with exact in the same run; its `pearson`, `spearman` attributes over every
# scored cell, written when the file is complete).
ERROR_SUFFIX = "_error"
PEARSON, SPEARMAN, CELLS = "pearson", "spearman", "cells"
# The /patching group's attribute: dataset indices of the rows whose clean − corrupted logit
# difference is 0 (every cell of their grid NaN), written when the file is complete.
UNSCORABLE = "unscorable"
# The /patching group's attribute (patching.clean runs): clean and corrupted count as equal
# when they differ by at most this share of the row's largest logit (/model/output), the
# stored clean logits' rounding; 0 (absent): only when they are equal.
CLEAN_TOLERANCE = "clean_tolerance"


def patching_key(name: str, suffix: str = "") -> str:
    return f"{PATCHING}/{name}{suffix}"


def flat_rows(
    clean: np.ndarray, corrupted: np.ndarray, logits: np.ndarray, tolerance: float
) -> np.ndarray:
    """Rows (N,) whose clean − corrupted logit difference is no difference: 0, or at most
    `tolerance` × the row's largest logit (`logits` (N, V))."""
    gap = np.abs(clean.astype(np.float64) - corrupted)
    if not tolerance:
        return gap == 0
    return gap <= tolerance * np.abs(logits.astype(np.float64)).max(axis=1)


def mark_unscorable(f: h5py.File, indices: np.ndarray) -> None:
    layout.set_attrs(f[PATCHING], {UNSCORABLE: np.asarray(indices, dtype=np.int64)})


def read_unscorable(f: h5py.File) -> np.ndarray | None:
    """The dataset indices of the rows patching could not score (None: no such record)."""
    group = f.get(PATCHING)
    if group is None or not layout.has_attrs(group, UNSCORABLE):
        return None
    return np.asarray(layout.attr(group, UNSCORABLE), dtype=np.int64)


def read_patching(ds: h5py.Dataset) -> tuple[list[str], np.ndarray]:
    """A patching grid's module per layer (attribute `layers`) and its `positions`."""
    layers = layout.attr(ds, "layers")
    return [str(x) for x in layers], np.asarray(layout.attr(ds, "positions"))


def agreement(exact: np.ndarray, approximate: np.ndarray) -> dict[str, float | int]:
    """An approximation's Pearson and Spearman correlations with the exact grid over every
    cell both scored (NaN: fewer than two, or no spread), and how many cells that is."""
    both = np.isfinite(exact) & np.isfinite(approximate)
    a, b = exact[both].astype(np.float64), approximate[both].astype(np.float64)
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return {PEARSON: float("nan"), SPEARMAN: float("nan"), CELLS: int(len(a))}
    from scipy.stats import spearmanr  # scipy: only when an approximation ran beside exact

    pearson = float(np.corrcoef(a, b)[0, 1])
    return {PEARSON: pearson, SPEARMAN: float(spearmanr(a, b).statistic), CELLS: int(len(a))}
