"""The `graph:` node (experiment=attribution_graph), typed and checked before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hookrun.errors import HookrunError
from hookrun.typed import Frozen, parse_typed

__all__ = ["GraphConfig", "parse_graph"]


@dataclass
class GraphConfig(Frozen):
    """The `graph:` node: the transcoders and what each prompt's graph keeps."""

    transcoders: str | None = None
    """A folder of per-layer transcoders, one for every layer's MLP: circuit-tracer's
    layer_<i>.safetensors with its config.yaml, or SAELens folders as experiment=train_sae
    saves them (one a layer)."""
    batch: int = 256
    """Target nodes whose rows one transposed pass computes (memory: batch x prompt x d)."""
    max_logits: int = 10
    """Logit nodes at most: the most probable next tokens."""
    logit_probability: float = 0.95
    """Logit nodes until their probabilities sum to this, in (0, 1]."""
    max_feature_nodes: int | None = None
    """Feature nodes at most (null: every active feature), chosen by their influence on the
    logits as circuit-tracer chooses them."""
    node_threshold: float = 0.8
    """Pruning keeps the nodes of this share of the influence, in (0, 1]."""
    edge_threshold: float = 0.98
    """Pruning keeps the edges of this share of the edge influence, in (0, 1]."""


def _count(key: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise HookrunError(f"{key}: {value!r}; valid: an integer >= {least}")


def _share(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise HookrunError(f"{key}: {value!r}; valid: a number in (0, 1]")


def parse_graph(raw: Any) -> GraphConfig | None:
    """The typed `graph:` node, or None where the config has none.

    Raises:
        HookrunError: a bad value, in one line naming the key.
    """
    if not raw:
        return None
    config = parse_typed(raw, GraphConfig, "graph")
    if not config.transcoders:
        raise HookrunError(
            "graph.transcoders: null; valid: a folder of per-layer transcoders (circuit-tracer's "
            "layer_<i>.safetensors, or experiment=train_sae's sae/ folder of one a layer)"
        )
    _count("graph.batch", config.batch)
    _count("graph.max_logits", config.max_logits)
    if config.max_feature_nodes is not None:
        _count("graph.max_feature_nodes", config.max_feature_nodes)
    for key in ("logit_probability", "node_threshold", "edge_threshold"):
        _share(f"graph.{key}", getattr(config, key))
    return config
