"""Where the sanity check's datasets are in captures.h5: /sanity/<method>/<similarity>
(N, steps + 1) and /sanity/<method>/maps; the /sanity group's attributes (the randomised
layers in order, the threshold) and each method's verdict (`passed`, `score`)."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from hookrun.io import layout

__all__ = [
    "SANITY",
    "VERDICT_SIMILARITY",
    "sanity_key",
    "sanity_attrs",
    "read_sanity",
    "verdict_of",
    "mark_verdict",
]

SANITY = "sanity"
# The similarity a sanity verdict is read from (Adebayo et al.: rank correlation of |map|).
VERDICT_SIMILARITY = "spearman_abs"
_VERDICT = ("passed", "score")


def sanity_key(method: str, similarity: str) -> str:
    """`/sanity/<method>/<similarity>` (N, steps + 1); similarity `maps`: (N, steps + 1, h, w)."""
    return f"{SANITY}/{method}/{similarity}"


def sanity_attrs(layers: list[str], threshold: float) -> dict[str, dict[str, Any]]:
    """The /sanity group's attributes: the randomised modules in order, and the threshold."""
    return {SANITY: {"layers": np.array(layers, dtype=h5py.string_dtype()), "threshold": threshold}}


def read_sanity(f: h5py.File) -> tuple[list[str], float]:
    """The /sanity group's randomised layers (in order) and its threshold."""
    group = f[SANITY]
    layers = layout.attr(group, "layers", [])
    return [str(x) for x in layers], float(layout.attr(group, "threshold", np.nan))


def verdict_of(f: h5py.File, method: str) -> tuple[bool, float] | None:
    """A method's sanity verdict (passed, score), or None where it has none yet (half a
    verdict is damage: verify says so)."""
    group = f[SANITY][method]
    if not layout.has_attrs(group, *_VERDICT):
        return None
    return bool(layout.attr(group, "passed")), float(layout.attr(group, "score"))


def mark_verdict(f: h5py.File, method: str, score: float, passed: bool) -> None:
    """A method's sanity verdict onto its /sanity group (before a file is complete)."""
    layout.set_attrs(f[SANITY][method], {"score": score, "passed": passed})
