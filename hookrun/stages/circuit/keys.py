"""Where edge attribution is stored in captures.h5: /circuit/edges (N, senders, receivers),
each row's score of every edge (NaN where the sender is not upstream of the receiver), with
the node names as the attributes `senders` and `receivers`; /circuit/clean and
/circuit/corrupted (N,), the two runs' logit differences; /circuit/faithfulness and
/circuit/faithfulness_logit_diff (sizes,), with the sizes as the attribute `k` and how each
circuit was chosen as `selection`, and /circuit/faithfulness_kept (sizes,), the edges each kept."""

from __future__ import annotations

import h5py
import numpy as np

from hookrun.io import layout

__all__ = [
    "CIRCUIT",
    "EDGES",
    "CLEAN",
    "CORRUPTED",
    "SENDERS",
    "RECEIVERS",
    "FAITHFULNESS",
    "FAITHFULNESS_DIFF",
    "PATHS",
    "PATHS_DIFF",
    "FAITHFULNESS_KEPT",
    "SELECTION",
    "kept_of",
]

CIRCUIT = "circuit"
EDGES = f"{CIRCUIT}/edges"
CLEAN = f"{CIRCUIT}/clean"
CORRUPTED = f"{CIRCUIT}/corrupted"
SENDERS, RECEIVERS = "senders", "receivers"
# circuit.k: per circuit size (attribute `k`), the share of clean − corrupted left with every
# other edge ablated, and the mean ablated logit difference; whole-run datasets.
FAITHFULNESS = f"{CIRCUIT}/faithfulness"
FAITHFULNESS_DIFF = f"{CIRCUIT}/faithfulness_logit_diff"
# Per size, how many of the k chosen edges the circuit kept (those on a path from the
# embeddings to the logits: faithfulness.circuit_of); the rule in words is their `selection`.
FAITHFULNESS_KEPT = f"{CIRCUIT}/faithfulness_kept"
SELECTION = "selection"
# circuit.paths: per row and sender, (patched − corrupted) / (clean − corrupted) with the
# named receivers reading its clean write (attribute `receivers`), and the patched logit
# difference.
PATHS = f"{CIRCUIT}/paths"
PATHS_DIFF = f"{CIRCUIT}/paths_logit_diff"


def kept_of(f: h5py.File) -> np.ndarray | None:
    """Each circuit's edges once pruned (/circuit/faithfulness_kept); None in a file from
    before circuits were pruned, or one whose whole-run work is not written yet."""
    ds = f.get(FAITHFULNESS_KEPT)
    if ds is None or layout.is_pending(ds):
        return None
    return ds[()].astype(np.int64)
