"""Influence, pruning and the two scores of an attribution graph, on its sparse adjacency.

circuit-tracer 0.5's graph.py, entry for entry: Â = |A| with each row divided by its sum
(clamped at 1e-10), so each target's incoming weights sum to 1; a node's influence is
w Â + w Â² + … with w the logits' probabilities (the graph is acyclic: the series ends);
`find_threshold` the value at which the scores, sorted descending, reach the share asked
for. Pruning keeps the nodes of `node_threshold` of the influence (tokens and logits
always), then the edges of `edge_threshold` of the edge scores Â' × (influence' + w) taken
on that pruned graph, then drops, to a fixpoint, feature and error nodes with no kept
outgoing edge and feature nodes with no kept incoming edge. Here every step runs over the
stored (non-zero) entries only: memory is a few arrays of the entries, never N × N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hookrun.stages.graph.attribution import Graph

__all__ = ["Pruned", "prune", "scores"]


@dataclass
class Pruned:
    """What pruning keeps: node and (per stored entry) edge masks, cumulative scores."""

    node_mask: Tensor  # (N,) bool
    edge_mask: Tensor  # (nnz,) bool, aligned with the graph's col / val
    cumulative: Tensor  # (N,) the share of influence of the nodes ranked at or above each
    influence: Tensor  # (N,) each node's influence on the logits, in the unpruned graph


def _normalised(rows: Tensor, val: Tensor, n: int) -> Tensor:
    weight = val.abs()
    total = torch.zeros(n).index_add_(0, rows, weight).clamp(min=1e-10)
    return weight / total[rows]


def _propagate(rows: Tensor, col: Tensor, weight: Tensor, w: Tensor) -> Tensor:
    """w Â + w Â² + … over the entries (target `rows`, source `col`, `weight`)."""
    current = torch.zeros_like(w).index_add_(0, col, weight * w[rows])
    total = current.clone()
    for _ in range(1000):
        if not current.any():
            return total
        current = torch.zeros_like(w).index_add_(0, col, weight * current[rows])
        total += current
    raise RuntimeError("influence did not vanish after 1000 steps: the graph has a cycle")


def _logit_weights(graph: Graph) -> Tensor:
    w = torch.zeros(graph.n_nodes)
    w[-graph.logit_probabilities.numel() :] = graph.logit_probabilities
    return w


def _threshold(scores: Tensor, share: float, zeros: int = 0) -> float:
    """The score at which the scores sorted descending reach `share` of their sum; `zeros`
    more scores of 0 stand at the end (the entries a dense matrix would hold)."""
    ordered = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(ordered, 0) / ordered.sum()
    index = int(torch.searchsorted(cumulative, share))
    if index >= ordered.numel():
        return 0.0 if zeros else float(ordered[-1])
    return float(ordered[index])


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's prune_graph (see the module docstring)."""
    n = graph.n_nodes
    k, t = graph.logit_probabilities.numel(), graph.n_tokens
    n_features = graph.selected.numel()
    rows, col, val = graph.rows(), graph.col, graph.val
    w = _logit_weights(graph)
    node_influence = _propagate(rows, col, _normalised(rows, val, n), w)
    node_mask = node_influence >= _threshold(node_influence, node_threshold)
    node_mask[-k - t :] = True
    kept = node_mask[rows] & node_mask[col]
    weight = _normalised(rows, val * kept, n)
    pruned_influence = _propagate(rows, col, weight, w) + w
    edge_scores = weight * pruned_influence[rows]
    dense_zeros = n * n - int(col.numel())
    cut = _threshold(edge_scores, edge_threshold, dense_zeros)
    edge_mask = edge_scores >= cut
    # a cut of 0 passes every entry of the dense matrix, zeros too: no node loses its edges
    everything = cut <= 0.0
    body = n - k - t  # features and errors
    old = node_mask.clone()
    while True:
        if not everything:
            outgoing = torch.zeros(n, dtype=torch.bool)
            outgoing[col[edge_mask]] = True
            incoming = torch.zeros(n, dtype=torch.bool)
            incoming[rows[edge_mask]] = True
            node_mask[:body] &= outgoing[:body]
            node_mask[:n_features] &= incoming[:n_features]
        if torch.equal(node_mask, old):
            break
        old = node_mask.clone()
        edge_mask &= node_mask[rows] & node_mask[col]
        everything = False
    ordered, order = torch.sort(node_influence, descending=True)
    cumulative = torch.zeros_like(node_influence)
    cumulative[order] = torch.cumsum(ordered, 0) / ordered.sum()
    return Pruned(node_mask, edge_mask, cumulative, node_influence)


def scores(graph: Graph, node_influence: Tensor | None = None) -> tuple[float, float]:
    """circuit-tracer's (replacement score, completeness score) of the whole graph;
    `node_influence`: the graph's, where pruning has computed it already."""
    n, t = graph.n_nodes, graph.n_tokens
    error_start = graph.selected.numel()
    error_end = error_start + t * graph.layers
    rows, col = graph.rows(), graph.col
    weight = _normalised(rows, graph.val, n)
    w = _logit_weights(graph)
    if node_influence is None:
        node_influence = _propagate(rows, col, weight, w)
    token = node_influence[error_end : error_end + t].sum()
    error = node_influence[error_start:error_end].sum()
    replacement = token / (token + error)
    from_errors = (col >= error_start) & (col < error_end)
    error_share = torch.zeros(n).index_add_(0, rows, weight * from_errors)
    output = node_influence + w
    completeness = ((1 - error_share) * output).sum() / output.sum()
    return float(replacement), float(completeness)
