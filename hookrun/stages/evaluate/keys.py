"""Where the evaluation's datasets are in captures.h5: /evaluate/<metric>/<attribution path>
(a curve, (N, columns), its attribute `fractions`), and a per-sample number beside it
(`.auc`, `.score`), which a sweep ranks by."""

from __future__ import annotations

import h5py
import numpy as np

from hookrun.io import layout

__all__ = ["EVALUATE", "FRACTIONS", "AUC_SUFFIX", "SCORE_SUFFIX", "evaluate_key", "read_fractions"]

EVALUATE = "evaluate"
FRACTIONS = "fractions"  # curves' attribute: the fraction of pixels perturbed per column
AUC_SUFFIX, SCORE_SUFFIX = ".auc", ".score"


def evaluate_key(dataset: str, attribution: str, suffix: str = "") -> str:
    """`/evaluate/<dataset>/<attribution path><suffix>` (suffix: '', AUC_SUFFIX, SCORE_SUFFIX)."""
    return f"{EVALUATE}/{dataset}/{attribution.strip('/')}{suffix}"


def read_fractions(ds: h5py.Dataset) -> np.ndarray:
    """The fraction of pixels perturbed at each column of an evaluation curve."""
    return np.asarray(layout.attr(ds, FRACTIONS))
