"""The `steering:` config node (experiment=steering), typed and checked before any work;
errors name `steering.<key>`. Its values are what the experiment's hook `hooks.steer` reads
(conf/experiment/steering.yaml): the layers, the prompt sets of the vector and its scale,
so a sweep over `steering.layers` × `steering.scale` is two overrides."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hookrun.errors import HookrunError
from hookrun.typed import Frozen, parse_typed

__all__ = ["SteeringConfig", "parse_steering", "EFFECTS"]

# The metric whose change (steered − unsteered, metrics stage) is a steering's effect:
# both grow as the steered model gives the rows' answers more weight.
EFFECTS = ("answer_logprob", "logit_diff")
_POSITIONS = ("last", "all")


@dataclass
class SteeringConfig(Frozen):
    layers: Any = None
    """The modules the vector is measured at and added to (their output): a hook per run, one
    vector per module.
    """
    plus: str | None = None
    """The prompt sets (.jsonl of {prompt} rows): the vector is mean(plus) − mean(minus)."""
    minus: str | None = None
    """The prompt set subtracted (.jsonl of {prompt} rows); see `plus`."""
    positions: str = "last"
    """Which tokens of each prompt are averaged: last | all."""
    scale: float = 1.0
    """Times the vector (after `normalize`, to unit length, when true)."""
    normalize: bool = False
    """Scale the vector to unit length before `scale` multiplies it."""
    effect: str = "answer_logprob"
    """The metric whose change measures the effect: answer_logprob | logit_diff."""


def parse_steering(raw: Mapping[str, Any] | None) -> SteeringConfig | None:
    if not raw:
        return None
    if "effect" in raw and raw["effect"] is None:  # OmegaConf's words name no choices
        raise HookrunError(f"steering.effect: null; valid: {', '.join(EFFECTS)}")
    config = parse_typed(raw, SteeringConfig, "steering")
    given = config.layers
    layers = [given] if isinstance(given, str) else given if isinstance(given, list | tuple) else []
    if not layers or not all(isinstance(x, str) and x for x in layers):
        raise HookrunError(
            f"steering.layers: {config.layers!r}; valid: one module name or a list of them "
            "(e.g. transformer.h.1)"
        )
    for key in ("plus", "minus"):
        if not getattr(config, key):
            raise HookrunError(f"steering.{key}: null; valid: a .jsonl of {{prompt}} rows")
    if config.positions not in _POSITIONS:
        raise HookrunError(
            f"steering.positions: {config.positions!r}; valid: {', '.join(_POSITIONS)}"
        )
    if not math.isfinite(config.scale):  # else the hook's args.scale says it, second-hand
        raise HookrunError(
            f"steering.scale: {config.scale}; valid: a finite number (0: the plain model)"
        )
    if config.effect not in EFFECTS:
        raise HookrunError(f"steering.effect: {config.effect!r}; valid: {', '.join(EFFECTS)}")
    return config
