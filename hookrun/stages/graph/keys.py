"""Where an attribution_graph run's file keeps each prompt's graph (docs/architecture.md).

/graph/<row>/: tokens (T,), features (n, 3) every active feature (layer, position, feature),
activations (n,), selected (F,) the features that are nodes, logit_tokens (K,),
logit_probabilities (K,), the adjacency in CSR (crow (N+1,), col (nnz,), val (nnz,): row =
target, column = source, node order features, errors, tokens, logits), influence (N,),
cumulative (N,), node_mask (N,), edge_mask (nnz,), logits (V,) the last position's,
intervention_logits (K, V) the last position's under each of graph.interventions (where the
file's `interventions` attribute K > 0); attributes replacement_score, completeness_score,
layers, nodes.
"""

from __future__ import annotations

JOB = "attribution_graph"
GROUP = "graph"
# <run dir>/graph/: each graph's JSON and page, and the listing circuit-tracer's viewer reads.
FILES = "graph"
TOKENS = "tokens"
FEATURES = "features"
ACTIVATIONS = "activations"
SELECTED = "selected"
LOGIT_TOKENS = "logit_tokens"
LOGIT_PROBABILITIES = "logit_probabilities"
CROW = "adjacency_crow"
COL = "adjacency_col"
VAL = "adjacency_val"
INFLUENCE = "influence"
CUMULATIVE = "cumulative"
NODE_MASK = "node_mask"
EDGE_MASK = "edge_mask"
LOGITS = "logits"
INTERVENTION_LOGITS = "intervention_logits"


def row_group(row: int) -> str:
    return f"{GROUP}/{row}"


# What every row's group holds in a complete file.
REQUIRED = (
    TOKENS,
    FEATURES,
    ACTIVATIONS,
    SELECTED,
    LOGIT_TOKENS,
    LOGIT_PROBABILITIES,
    CROW,
    COL,
    VAL,
    INFLUENCE,
    CUMULATIVE,
    NODE_MASK,
    EDGE_MASK,
    LOGITS,
)
