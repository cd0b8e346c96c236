"""The `evaluate:` config node, merged into dataclasses and checked before any work (errors
name `evaluate.<key>`). `evaluate=faithfulness` (conf/evaluate/faithfulness.yaml) sets the
metrics and their arguments; an empty node turns evaluation off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hookrun.errors import HookrunError, unknown_key
from hookrun.stages.evaluate.registry import FAITHFULNESS_METRICS
from hookrun.stages.evaluate.relevance import REDUCTIONS
from hookrun.typed import Frozen, check_range, parse_typed

__all__ = ["EvaluateConfig", "EvaluateSpec", "parse_evaluate"]


@dataclass
class EvaluateConfig(Frozen):
    metrics: list[str] = field(default_factory=lambda: ["deletion", "insertion", "road"])
    """Metrics computed for every evaluated attribution, in order (hookrun/stages/evaluate/)."""
    of: list[str] | None = None
    """Attribution paths to evaluate (derived/<method>/<layer|input>, captures/input/ grad_output);
    null: every attribution the run makes.
    """
    reduce: str = "abs_sum"
    """Input-shaped attributions (N, C, H, W) → pixel relevance: abs_sum | sum | max_abs."""
    batch_size: int | None = None
    """Perturbed images per forward pass; null: as many as 8M input values allow."""
    rank_by: str | None = None
    """What a sweep ranks its jobs by; null: road when it is computed, else the first metric."""


@dataclass(frozen=True)
class EvaluateSpec:
    """The parsed `evaluate:` node: general keys, each metric's Args, the ranking metric."""

    config: EvaluateConfig
    metrics: tuple[tuple[str, Any], ...]  # (name, parsed Args) in `metrics` order
    rank_by: str


def _unknown(raw: Mapping[str, Any], valid: list[str], key: str) -> None:
    for name in raw:
        if name not in valid:
            raise unknown_key(key, name, valid)


def parse_evaluate(raw: Mapping[str, Any] | None) -> EvaluateSpec | None:
    """The EvaluateSpec of an `evaluate:` node (None when it is empty)."""
    if not raw:
        return None
    general = [f.name for f in dataclasses.fields(EvaluateConfig)]
    _unknown(raw, general + FAITHFULNESS_METRICS.choices(), "evaluate")
    config = parse_typed({k: v for k, v in raw.items() if k in general}, EvaluateConfig, "evaluate")
    if not config.metrics:
        raise HookrunError(
            f"evaluate.metrics: []; valid: any of {', '.join(FAITHFULNESS_METRICS.choices())}"
        )
    for i, name in enumerate(config.metrics):
        FAITHFULNESS_METRICS.get(name, f"evaluate.metrics[{i}]")
    if len(set(config.metrics)) != len(config.metrics):
        raise HookrunError(f"evaluate.metrics: {list(config.metrics)} names a metric twice")
    if config.reduce not in REDUCTIONS:
        raise HookrunError(f"evaluate.reduce: {config.reduce!r}; valid: {', '.join(REDUCTIONS)}")
    check_range("evaluate.batch_size", config.batch_size, 1, allow_none=True)
    if config.of is not None and not config.of:
        raise HookrunError("evaluate.of: []; valid: attribution paths, or null for every one")
    parsed = []
    for name in FAITHFULNESS_METRICS.choices():  # every node is checked, also of a metric not run
        metric = FAITHFULNESS_METRICS.get(name, "evaluate.metrics")
        args = parse_typed(raw.get(name), metric.Args, f"evaluate.{name}")
        metric.check(args, f"evaluate.{name}")
        parsed.append((name, args))
    by_name = dict(parsed)
    rank_by = config.rank_by or ("road" if "road" in config.metrics else config.metrics[0])
    if rank_by not in config.metrics:
        raise HookrunError(
            f"evaluate.rank_by: {rank_by!r} is not computed; valid: {', '.join(config.metrics)}"
        )
    return EvaluateSpec(config, tuple((m, by_name[m]) for m in config.metrics), rank_by)
