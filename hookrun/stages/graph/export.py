"""circuit-tracer's graph JSON (its utils/create_graph_files.py and frontend/graph_models.py),
so its local viewer (`circuit-tracer start-server`) and Neuronpedia open hookrun's graphs.

Nodes: those pruning keeps that touch a kept edge, and every token and logit node; ids as
circuit-tracer spells them (a feature `{layer}_{feature}_{pos}`, an error `0_{layer}_{pos}`,
a token `E_{id}_{pos}`, a logit `{layers + 1}_{id}_{last pos}`); `influence` is the node's
cumulative score; links `{source, target, weight}` for the kept edges.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hookrun.stages.graph.attribution import Graph
from hookrun.stages.graph.prune import Pruned

__all__ = ["graph_json", "write_graph_row", "write_listing"]


def _node(node_id: str, feature: int, layer: str, pos: int, kind: str, js: str, **extra: Any):
    node = {
        "node_id": node_id,
        "feature": feature,
        "layer": layer,
        "ctx_idx": pos,
        "feature_type": kind,
        "token_prob": 0.0,
        "is_target_logit": False,
        "run_idx": 0,
        "reverse_ctx_idx": 0,
        "jsNodeId": js,
        "clerp": "",
        "influence": None,
        "activation": None,
    }
    node.update(extra)
    return node


def _nodes(graph: Graph, pruned: Pruned, decode) -> dict[int, dict[str, Any]]:
    n_features, t, layers = graph.selected.numel(), graph.n_tokens, graph.layers
    error_end = n_features + t * layers
    token_end = error_end + t
    cumulative = pruned.cumulative.tolist()
    nodes = {}
    for i in pruned.node_mask.nonzero().flatten().tolist():
        score = cumulative[i]
        if i < n_features:
            chosen = int(graph.selected[i])
            layer, pos, feat = graph.features[chosen].tolist()
            nodes[i] = _node(
                f"{layer}_{feat}_{pos}",
                (layer + feat) * (layer + feat + 1) // 2 + feat,  # Cantor pairing, as theirs
                str(layer),
                pos,
                "cross layer transcoder",
                f"{layer}_{feat}-0",
                influence=score,
                activation=float(graph.activations[chosen]),
            )
        elif i < error_end:
            layer, pos = divmod(i - n_features, t)
            nodes[i] = _node(
                f"0_{layer}_{pos}",
                -1,
                str(layer),
                pos,
                "mlp reconstruction error",
                f"{layer}_{pos}-0",
                influence=score,
            )
        elif i < token_end:
            pos = i - error_end
            vocab = int(graph.tokens[pos])
            nodes[i] = _node(
                f"E_{vocab}_{pos}", pos, "E", pos, "embedding", f"E_{vocab}-{pos}", influence=score
            )
        else:
            k = i - token_end
            vocab = int(graph.logit_tokens[k])
            p = float(graph.logit_probabilities[k])
            layer = str(layers + 1)
            nodes[i] = _node(
                f"{layer}_{vocab}_{t - 1}",
                vocab,
                layer,
                t - 1,
                "logit",
                f"L_{vocab}-{t - 1}",
                token_prob=p,
                is_target_logit=k == 0,
                clerp=f'Output "{decode([vocab])}" (p={p:.3f})',
            )
    return nodes


def graph_json(
    graph: Graph, pruned: Pruned, decode, *, slug: str, scan: str, node_threshold: float
) -> dict[str, Any]:
    """The graph as circuit-tracer's JSON (a dict); `decode(ids) -> str` the tokenizer's."""
    nodes = _nodes(graph, pruned, decode)
    rows = graph.rows()[pruned.edge_mask].tolist()
    cols = graph.col[pruned.edge_mask].tolist()
    weights = graph.val[pruned.edge_mask].tolist()
    links = [
        {"source": nodes[s]["node_id"], "target": nodes[d]["node_id"], "weight": w}
        for d, s, w in sorted(zip(rows, cols, weights, strict=True))
        if s in nodes and d in nodes
    ]
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    kept = [
        node
        for node in nodes.values()
        if node["node_id"] in connected or node["feature_type"] in ("embedding", "logit")
    ]
    metadata = {
        "slug": slug,
        "scan": scan,
        "transcoder_list": [],
        "prompt_tokens": [decode([int(t)]) for t in graph.tokens],
        "prompt": decode(graph.tokens.tolist()),
        "node_threshold": node_threshold,
        "schema_version": 1,
    }
    q = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": q, "nodes": kept, "links": links}


def write_graph_row(folder: Path, graph: dict[str, Any], page: str) -> None:
    """A graph's `<slug>.json` and its page `<slug>.html` (page.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    slug = graph["metadata"]["slug"]
    (folder / f"{slug}.json").write_text(json.dumps(graph, indent=2), encoding="utf-8")
    (folder / f"{slug}.html").write_text(page, encoding="utf-8")


def write_listing(folder: Path, metadata: list[dict[str, Any]]) -> None:
    """The folder's graph-metadata.json: the viewer's list of its graphs."""
    folder.mkdir(parents=True, exist_ok=True)
    listing = json.dumps({"graphs": metadata}, indent=2)
    (folder / "graph-metadata.json").write_text(listing, encoding="utf-8")
