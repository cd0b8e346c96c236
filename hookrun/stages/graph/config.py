"""The `graph:` node (experiment=attribution_graph), typed and checked before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hookrun.errors import HookrunError
from hookrun.runtime.splice import EditArgs, parse_edit
from hookrun.typed import Frozen, parse_typed

__all__ = ["GraphConfig", "FeatureEdit", "parse_graph"]


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
    dashboards: str | None = None
    """A features run's folder (or its view/ folder) over the same transcoders
    (experiment=features, then python -m hookrun.view): each feature node of a graph's page
    links to its latent's page there. null: the pages name the latents, unlinked."""
    interventions: Any = None
    """Interventions on feature nodes, each run on every prompt: an edit, or a list of edits
    made together, `{layer: L, position: P, latents: [j, ...], op: zero | scale | clamp |
    set, value: x}` (position: the prompt's, negative from its end); the last position's
    logits under each are stored. As circuit-tracer's feature_intervention: attention
    patterns frozen at the prompt's, the real MLPs run, and an edited latent adds its change
    times its decoder row to its layer's MLP output, the latents later layers see
    recomputed."""


@dataclass(frozen=True)
class FeatureEdit:
    """One edit of an intervention: `edit` on the latents of `layer`'s transcoder at the
    prompt's `positions` (negative: from the prompt's end)."""

    layer: int
    positions: tuple[int, ...]
    edit: EditArgs


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
    given = config.interventions or []
    if hasattr(given, "keys"):  # one edit given alone: one intervention
        given = [given]
    config.interventions = [
        _intervention(entry, f"graph.interventions[{i}]") for i, entry in enumerate(given)
    ]
    return config


def _integers(key: str, value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise HookrunError(f"{key}: {value!r}; valid: an integer or a list of integers")
    return tuple(int(v) for v in items)


def _intervention(raw: Any, key: str) -> tuple[FeatureEdit, ...]:
    """One entry of graph.interventions: an edit or a non-empty list of them."""
    edits = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if not edits or not all(hasattr(e, "keys") for e in edits):
        raise HookrunError(
            f"{key}: {raw!r}; valid: an edit {{layer, position, latents, op, value}} or a "
            "list of them"
        )
    parsed = []
    for j, e in enumerate(edits):
        where = f"{key}[{j}]" if isinstance(raw, (list, tuple)) else key
        e = dict(e)
        unknown = sorted(set(e) - {"layer", "position", "latents", "op", "value"})
        if unknown or "layer" not in e or "position" not in e:
            raise HookrunError(
                f"{where}: {unknown[0] if unknown else 'layer and position'} "
                f"{'unknown' if unknown else 'missing'}; valid: layer, position, latents, op, value"
            )
        layer = e.pop("layer")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise HookrunError(f"{where}.layer: {layer}; valid: a layer index >= 0")
        positions = _integers(f"{where}.position", e.pop("position"))
        parsed.append(FeatureEdit(layer, positions, parse_edit(e, where)))
    return tuple(parsed)
