"""The `evaluate:` and `sanity:` config nodes, merged into dataclasses and checked before any
work (errors name `evaluate.<key>` / `sanity.<key>`).

`evaluate=faithfulness` (conf/evaluate/faithfulness.yaml) sets the metrics and their
arguments; `experiment=sanity_check` sets `sanity:`. An empty node turns either off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hookrun.errors import HookrunError, nearest
from hookrun.stages.evaluate.registry import METRICS
from hookrun.stages.evaluate.relevance import REDUCTIONS
from hookrun.typed import Frozen, check_range, parse_typed

__all__ = [
    "EvaluateConfig",
    "EvaluateSpec",
    "parse_evaluate",
    "SanityConfig",
    "SANITY_MODES",
    "SIMILARITIES",
    "parse_sanity",
]

SANITY_MODES = ("cascading", "independent")
# How a randomised model's map is compared with the original's (stages/sanity/similarity.py).
SIMILARITIES = ("spearman_abs", "spearman", "ssim")


@dataclass
class EvaluateConfig(Frozen):
    # Metrics computed for every evaluated attribution, in order (hookrun/evaluate/).
    metrics: list[str] = field(default_factory=lambda: ["deletion", "insertion", "road"])
    # Attribution paths to evaluate (derived/<method>/<layer|input>, captures/input/
    # grad_output); null: every attribution the run makes.
    of: list[str] | None = None
    # Input-shaped attributions (N, C, H, W) → pixel relevance: abs_sum | sum | max_abs.
    reduce: str = "abs_sum"
    # Perturbed images per forward pass; null: as many as 8M input values allow.
    batch_size: int | None = None
    # What a sweep ranks its jobs by; null: road when it is computed, else the first metric.
    rank_by: str | None = None


@dataclass(frozen=True)
class EvaluateSpec:
    """The parsed `evaluate:` node: general keys, each metric's Args, the ranking metric."""

    config: EvaluateConfig
    metrics: tuple[tuple[str, Any], ...]  # (name, parsed Args) in `metrics` order
    rank_by: str


def _unknown(raw: Mapping[str, Any], valid: list[str], key: str) -> None:
    for name in raw:
        if name not in valid:
            hint = nearest(str(name), valid, n=1)
            did = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise HookrunError(f"{key}.{name}: unknown key{did}; valid keys: {', '.join(valid)}")


def parse_evaluate(raw: Mapping[str, Any] | None) -> EvaluateSpec | None:
    """The EvaluateSpec of an `evaluate:` node (None when it is empty)."""
    if not raw:
        return None
    general = [f.name for f in dataclasses.fields(EvaluateConfig)]
    _unknown(raw, general + METRICS.choices(), "evaluate")
    config = parse_typed({k: v for k, v in raw.items() if k in general}, EvaluateConfig, "evaluate")
    if not config.metrics:
        raise HookrunError(f"evaluate.metrics: []; valid: any of {', '.join(METRICS.choices())}")
    for i, name in enumerate(config.metrics):
        METRICS.get(name, f"evaluate.metrics[{i}]")
    if len(set(config.metrics)) != len(config.metrics):
        raise HookrunError(f"evaluate.metrics: {list(config.metrics)} names a metric twice")
    if config.reduce not in REDUCTIONS:
        raise HookrunError(f"evaluate.reduce: {config.reduce!r}; valid: {', '.join(REDUCTIONS)}")
    check_range("evaluate.batch_size", config.batch_size, 1, allow_none=True)
    if config.of is not None and not config.of:
        raise HookrunError("evaluate.of: []; valid: attribution paths, or null for every one")
    parsed = []
    for name in METRICS.choices():  # every node is checked, also of a metric not run
        metric = METRICS.get(name, "evaluate.metrics")
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


@dataclass
class SanityConfig(Frozen):
    # Experiments whose attribution is checked (each makes one: a derived result or the
    # input gradient); their hooks and derive run on the original and randomised models.
    methods: list[str] = field(
        default_factory=lambda: [
            "saliency",
            "guided_bp",
            "grad_cam",
            "integrated_gradients",
            "smoothgrad",
        ]
    )
    # Modules randomised, in order; auto: the output layer, then the feature extractor's
    # blocks from the last to the first (stages/sanity/randomize.py).
    layers: Any = "auto"
    # cascading: each step randomises one more layer; independent: one layer at a time.
    mode: str = "cascading"
    # Input-shaped maps (C, H, W) → (H, W): abs_sum | sum | max_abs.
    reduce: str = "abs_sum"
    # A method passes when the mean over the steps of the median spearman_abs is below this.
    threshold: float = 0.5
    # Store every compared map at every step (/sanity/<method>/maps); the grid needs them.
    keep_maps: bool = True
    # Per derived method, arguments over its experiment's (e.g. integrated_gradients:
    # {steps: 16}).
    derive: dict[str, Any] = field(default_factory=dict)


def _twice(names: Any) -> str | None:
    """The first name listed a second time in `names`; None when they are distinct."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def parse_sanity(raw: Mapping[str, Any] | None, choices: list[str]) -> SanityConfig | None:
    """The SanityConfig of a `sanity:` node (None when empty); `choices`: the experiments
    that make one attribution."""
    if not raw:
        return None
    config = parse_typed(raw, SanityConfig, "sanity")
    if not config.methods:
        raise HookrunError(f"sanity.methods: []; valid: any of {', '.join(choices)}")
    for i, name in enumerate(config.methods):
        if name not in choices:
            hint = nearest(str(name), choices, n=1)
            did = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise HookrunError(
                f"sanity.methods[{i}]: {name!r} is not an experiment that makes one "
                f"attribution; valid: {', '.join(choices)}{did}"
            )
    twice = _twice(config.methods)
    if twice is not None:
        raise HookrunError(
            f"sanity.methods: {list(config.methods)} names {twice!r} twice; valid: distinct "
            f"methods, any of {', '.join(choices)}"
        )
    layers = config.layers
    if layers != "auto" and not (
        isinstance(layers, list) and layers and all(isinstance(x, str) and x for x in layers)
    ):
        raise HookrunError(
            f"sanity.layers: {layers!r}; valid: auto, or a list of module names (randomised "
            "in that order)"
        )
    twice = _twice(layers) if layers != "auto" else None
    if twice is not None:  # the same randomisation step twice
        raise HookrunError(
            f"sanity.layers: {list(layers)} names {twice!r} twice; valid: auto, or a list of "
            "distinct module names (randomised in that order)"
        )
    if config.mode not in SANITY_MODES:
        raise HookrunError(f"sanity.mode: {config.mode!r}; valid: {', '.join(SANITY_MODES)}")
    if config.reduce not in REDUCTIONS:
        raise HookrunError(f"sanity.reduce: {config.reduce!r}; valid: {', '.join(REDUCTIONS)}")
    if not (math.isfinite(config.threshold) and -1 <= config.threshold <= 1):
        raise HookrunError(
            f"sanity.threshold: {config.threshold}; valid: a number in [-1, 1] (a rank correlation)"
        )
    return config
