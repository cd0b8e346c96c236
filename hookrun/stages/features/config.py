"""The `features:` node (experiment=features), typed and checked before any work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookrun.errors import HookrunError
from hookrun.typed import Frozen, parse_typed

__all__ = ["FeaturesConfig", "parse_features", "GROUPINGS"]

GROUPINGS = ("intervals", "quantiles")


@dataclass
class FeaturesConfig(Frozen):
    """The `features:` node: what each unit's dashboard holds."""

    k: int = 20
    """Top-activating contexts kept per unit (ties: the smaller (row, token) first)."""
    window: list[int] = field(default_factory=lambda: [16, 8])
    """[before, after]: the tokens kept around each context's maximum (text data)."""
    groups: int = 5
    """Activation groups the samples are drawn from (the lowest group first)."""
    per_group: int = 5
    """Samples per group (the tokens of the group with the smallest hash of (row, token,
    unit): deterministic, the same over a resume or torchrun's ranks)."""
    grouping: str = "intervals"
    """intervals: equal widths of [0, max] as SAEDashboard's interval groups; quantiles: equal
    counts of the firing tokens. Either is snapped to the histogram's bins."""
    bins: int = 64
    """Histogram bins of each unit's firing activations, over [0, 2^e] (2^e the smallest power
    of two at least its max): a power of two, 2 to 4096."""
    logits: int = 10
    """Top and bottom logit effects kept per latent of a residual-stream dictionary (0: none)."""
    checkpoint_rows: int = 1024
    """Rows between checkpoints (rounded up to whole batches); a signal checkpoints too."""
    patch: int = 32
    """Image data: each top context's receptive-field crop resized to patch x patch pixels."""


def _positive(key: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise HookrunError(f"{key}: {value!r}; valid: an integer >= {least}")


def parse_features(raw: Any) -> FeaturesConfig | None:
    """The typed `features:` node, or None where the config has none.

    Raises:
        HookrunError: a bad value, in one line naming the key.
    """
    if not raw:
        return None
    config = parse_typed(raw, FeaturesConfig, "features")
    _positive("features.k", config.k)
    window = list(config.window)
    if len(window) != 2 or any(isinstance(w, bool) or not isinstance(w, int) for w in window):
        raise HookrunError(
            f"features.window: {window!r}; valid: [before, after], two integers >= 0"
        )
    if min(window) < 0:
        raise HookrunError(
            f"features.window: {window!r} has a negative size; valid: [before, after], two "
            "integers >= 0"
        )
    _positive("features.groups", config.groups)
    _positive("features.per_group", config.per_group)
    _positive("features.logits", config.logits, least=0)
    _positive("features.checkpoint_rows", config.checkpoint_rows)
    _positive("features.patch", config.patch)
    bins = config.bins
    if (
        isinstance(bins, bool)
        or not isinstance(bins, int)
        or not 2 <= bins <= 4096
        or bins & (bins - 1)
    ):
        raise HookrunError(f"features.bins: {bins!r}; valid: a power of two, 2 to 4096")
    if config.grouping not in GROUPINGS:
        raise HookrunError(f"features.grouping: {config.grouping!r}; valid: {', '.join(GROUPINGS)}")
    return config
