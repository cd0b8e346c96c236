"""Where the induction scores are in captures.h5: /induction/score (layers, heads) with the
layer names in its attribute `layers`, and each row's /induction/rows (N, layers, heads);
written once the file is complete (no sample axis of their own)."""

from __future__ import annotations

import h5py

from hookrun.io import layout

__all__ = ["INDUCTION_SCORE", "INDUCTION_ROWS", "LAYERS_ATTR", "induction_layers"]

INDUCTION_SCORE, INDUCTION_ROWS, LAYERS_ATTR = "induction/score", "induction/rows", "layers"


def induction_layers(f: h5py.File) -> list[str]:
    """The layer names of /induction/score's rows."""
    return [str(x) for x in layout.attr(f[INDUCTION_SCORE], LAYERS_ATTR, [])]
