"""The `sanity:` config node (experiment=sanity_check), merged into a dataclass and checked
before any work (errors name `sanity.<key>`), and each checked method's hooks and derived
results, read from its experiment file (config/experiments.py). An empty node turns the
check off."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hookrun.config.build import parse_hooks
from hookrun.config.experiments import attribution_experiments, derived_by, method_nodes
from hookrun.errors import HookrunError, did_you_mean
from hookrun.runtime.hookspec import HookSpec
from hookrun.stage import ParseContext
from hookrun.stages.derive.registry import METHODS
from hookrun.stages.derive.stage import parse_derive
from hookrun.stages.evaluate.relevance import REDUCTIONS
from hookrun.typed import Frozen, freeze, parse_typed

__all__ = [
    "SanityConfig",
    "SanityMethod",
    "SanitySpec",
    "SANITY_MODES",
    "SIMILARITIES",
    "parse_sanity",
    "sanity_spec",
]

SANITY_MODES = ("cascading", "independent")
# How a randomised model's map is compared with the original's (sanity/similarity.py).
SIMILARITIES = ("spearman_abs", "spearman", "ssim")


@dataclass
class SanityConfig(Frozen):
    methods: list[str] = field(
        default_factory=lambda: [
            "saliency",
            "guided_bp",
            "grad_cam",
            "integrated_gradients",
            "smoothgrad",
        ]
    )
    """Experiments whose attribution is checked (each makes one: a derived result or the input
    gradient); their hooks and derive run on the original and randomised models.
    """
    layers: Any = "auto"
    """Modules randomised, in order; auto: the output layer, then the feature extractor's blocks
    from the last to the first (stages/sanity/randomize.py).
    """
    mode: str = "cascading"
    """cascading: each step randomises one more layer; independent: one layer at a time."""
    reduce: str = "abs_sum"
    """Input-shaped maps (C, H, W) → (H, W): abs_sum | sum | max_abs."""
    threshold: float = 0.5
    """A method passes when the mean over the steps of the median spearman_abs is below this."""
    keep_maps: bool = True
    """Store every compared map at every step (/sanity/<method>/maps); the grid needs them."""
    derive: dict[str, Any] = field(default_factory=dict)
    """Per derived method, arguments over its experiment's (e.g. integrated_gradients: {steps:
    16}).
    """


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
            did = did_you_mean(name, choices)
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


@dataclass(frozen=True)
class SanityMethod:
    """One method of the sanity check: its experiment's hooks and derived results."""

    name: str  # the experiment (conf/experiment/<name>.yaml)
    hooks: tuple[HookSpec, ...]
    derive: Any  # method name → parsed Args, read-only, in file order

    @property
    def derived(self) -> str | None:
        """The derived method whose result is the map; None: the input gradient is."""
        return list(self.derive)[-1] if self.derive else None


@dataclass(frozen=True)
class SanitySpec:
    """`sanity:` parsed: its keys and each checked method's hooks and derived results."""

    config: SanityConfig
    methods: tuple[SanityMethod, ...]


def _map_experiments() -> list[str]:
    """The experiments whose attribution is a relevance map (not the logit lens's table)."""
    return [
        name
        for name in attribution_experiments()
        if all(METHODS.get(m, "derive").makes_map for m in derived_by(name))
    ]


def sanity_spec(raw: Any, ctx: ParseContext) -> SanitySpec | None:
    """Each checked method's hooks and derived results, from its experiment file with
    `sanity.derive.<method>` over its arguments."""
    if not raw:  # no check: the experiment files the choices come from are not read (~0.5 s)
        return None
    config = parse_sanity(raw, _map_experiments())
    if config is None:
        return None
    overrides, methods = dict(config.derive), []
    for name in config.methods:
        hooks_raw, derive_raw = method_nodes(name, ctx.cfg)
        for method in derive_raw:
            if method in overrides:
                derive_raw[method] = {**(derive_raw[method] or {}), **(overrides[method] or {})}
        hooks = parse_hooks(hooks_raw, ctx.target)
        derive = parse_derive(derive_raw, ctx.target, prefix="sanity.derive", dataset=ctx.dataset)
        methods.append(SanityMethod(name, hooks, freeze(derive)))
    for method in overrides:  # the preset's arguments for a method left out do nothing
        METHODS.get(method, f"sanity.derive.{method}")
    return SanitySpec(freeze(config), tuple(methods))
