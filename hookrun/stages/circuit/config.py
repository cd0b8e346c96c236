"""The `circuit:` config node (experiment=circuit), typed and checked before any work;
errors name `circuit.<key>`. An empty node turns the stage off."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hookrun.errors import HookrunError, did_you_mean
from hookrun.typed import Frozen, check_range, freeze, parse_typed

__all__ = ["CircuitConfig", "parse_circuit", "METHODS", "ABLATIONS"]

METHODS = ("eap", "eap_ig")
ABLATIONS = ("corrupted", "mean")


@dataclass
class CircuitConfig(Frozen):
    method: str = field(default="eap", metadata={"choices": METHODS})
    """eap: the gradient at the corrupted run; eap_ig: averaged over ig_steps runs whose input
    embeddings lie k / ig_steps of the way from the corrupted prompt to the clean one, k = 0 ...
    ig_steps - 1 (edges.py; beside Hanna et al.'s: edges.gradient_at).
    """
    ig_steps: int = 8
    """eap_ig: the runs between the corrupted and the clean prompt whose gradients are averaged."""
    k: Any = field(default_factory=list)
    """Circuits of these sizes (the k edges of largest mean |score|, those of them on a path from
    the embeddings to the logits: faithfulness.circuit_of), each run with every other edge
    ablated once the scores are known: /circuit/faithfulness. []: none; auto: 0, 1, 2, 5, 10,
    20, 50, ... up to every edge of the model.
    """
    ablation: str = field(default="corrupted", metadata={"choices": ABLATIONS})
    """What an edge outside the circuit carries instead of its sender's write: the sender's write
    in the row's corrupted run, or its mean over every row's corrupted run at that position
    (mean ablation).
    """
    paths: Any = field(default_factory=list)
    """Path patching: each sender's clean write read by these receivers alone (names as in
    /circuit/edges' receivers: a0, m0, ..., logits), every other path corrupted: /circuit/paths.
    []: none.
    """


def _names(paths: Any) -> list[str]:
    """circuit.paths as a list of receiver names (one name alone is a list of one)."""
    names = (
        [paths]
        if isinstance(paths, str)
        else list(paths)
        if isinstance(paths, list | tuple)
        else None
    )
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise HookrunError(
            f"circuit.paths: {paths!r}; valid: a list of receivers, e.g. [logits] or "
            "[a1.h0.q, a1.h0.k, m1] (a1: every head's query, key and value in layer 1)"
        )
    if len(set(names)) != len(names):
        raise HookrunError(f"circuit.paths: {names} names a receiver twice; valid: each once")
    return names


def parse_circuit(raw: Mapping[str, Any] | None) -> CircuitConfig | None:
    if not raw:
        return None
    config = parse_typed(raw, CircuitConfig, "circuit")
    if config.method not in METHODS:
        did = did_you_mean(str(config.method), METHODS)
        raise HookrunError(f"circuit.method: {config.method!r}{did}; valid: {', '.join(METHODS)}")
    check_range("circuit.ig_steps", config.ig_steps, 1)
    if config.ablation not in ABLATIONS:
        did = did_you_mean(str(config.ablation), ABLATIONS)
        raise HookrunError(
            f"circuit.ablation: {config.ablation!r}{did}; valid: {', '.join(ABLATIONS)}"
        )
    config.paths = _names(config.paths)
    if config.k == "auto":
        return freeze(config)
    sizes = list(config.k) if isinstance(config.k, list | tuple) else [config.k]
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in sizes):
        raise HookrunError(
            f"circuit.k: {config.k!r}; valid: a list of edge counts (ints >= 0), or auto"
        )
    if len(set(sizes)) != len(sizes):
        raise HookrunError(f"circuit.k: {sizes} names a size twice; valid: each once")
    config.k = sizes  # one size given alone is a list of one
    return freeze(config)
