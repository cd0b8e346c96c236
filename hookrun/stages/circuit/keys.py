"""Where edge attribution is stored in captures.h5: /circuit/edges (N, senders, receivers),
each row's score of every edge (NaN where the sender is not upstream of the receiver), with
the node names as the attributes `senders` and `receivers`; /circuit/clean and
/circuit/corrupted (N,), the two runs' logit differences; /circuit/faithfulness and
/circuit/faithfulness_logit_diff (sizes,), with the sizes as the attribute `k`, the edges each
circuit kept as `kept` and how they were chosen as `selection`."""

from __future__ import annotations

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
    "KEPT",
    "SELECTION",
]

CIRCUIT = "circuit"
EDGES = f"{CIRCUIT}/edges"
CLEAN = f"{CIRCUIT}/clean"
CORRUPTED = f"{CIRCUIT}/corrupted"
SENDERS, RECEIVERS = "senders", "receivers"
# circuit.k: per circuit size (attribute `k`), the share of clean − corrupted left with every
# other edge ablated, and the mean ablated logit difference; written once the file is complete.
FAITHFULNESS = f"{CIRCUIT}/faithfulness"
FAITHFULNESS_DIFF = f"{CIRCUIT}/faithfulness_logit_diff"
# Their attributes: per size, how many of the k chosen edges the circuit kept (those on a path
# from the embeddings to the logits: faithfulness.circuit_of), and that rule in words.
KEPT, SELECTION = "kept", "selection"
# circuit.paths: per row and sender, (patched − corrupted) / (clean − corrupted) with the
# named receivers reading its clean write (attribute `receivers`), and the patched logit
# difference.
PATHS = f"{CIRCUIT}/paths"
PATHS_DIFF = f"{CIRCUIT}/paths_logit_diff"
