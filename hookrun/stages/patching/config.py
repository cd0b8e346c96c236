"""The `patching:` config node (experiment=lm_patching), merged into a dataclass and checked
before any work; errors name `patching.<key>`. An empty node turns patching off."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hookrun.errors import HookrunError, did_you_mean
from hookrun.typed import Frozen, check_choices, check_range, freeze, parse_typed

__all__ = [
    "PatchingConfig",
    "SITE_KINDS",
    "METHODS",
    "APPROXIMATIONS",
    "parse_patching",
    "chosen_layers",
]

# resid: each block's output; attn: each attention module's output; mlp: each MLP's output;
# heads: each attention head's output (its slice of the output projection's input).
SITE_KINDS = ("resid", "attn", "mlp", "heads")
# exact: a patched pass per cell; atp: attribution patching (first order, one backward);
# atp_ig: its gradient averaged from the corrupted to the clean input (attribution.py).
METHODS = ("exact", "atp", "atp_ig")
APPROXIMATIONS = ("atp", "atp_ig")


@dataclass
class PatchingConfig(Frozen):
    sites: list[str] = field(default_factory=lambda: ["resid"])
    """Site kinds patched, each a grid of its own: resid | attn | mlp | heads (a grid of layers ×
    heads × positions).
    """
    positions: Any = "all"
    """Positions patched: all (every position of the padded rows; past a row's last real token its
    cells are NaN) or a list of positions (0-based, inside every row).
    """
    layer: Any = "all"
    """Layers patched: all, one layer (an int: `--multirun patching.layer=0,1,2` gives one cluster
    job per layer, each the matching slice of the all-layers grid) or a list.
    """
    clean: str | None = None
    """A stored clean run (a captures.h5 of the same prompts, stages/patching/clean.py) read
    instead of a clean forward pass: clean and corrupted as separate jobs. null: one run does
    both.
    """
    batch_size: int | None = None
    """Rows per patched forward pass (copies of the corrupted batch × its rows); null: as many as
    `memory_mib` of activations allow (grid.py says the estimate).
    """
    memory_mib: int = 256
    """The activations one patched forward pass may hold, when batch_size is null."""
    method: Any = "exact"
    """How each cell is found: exact | atp | atp_ig, or a list of them (each its own grid; with
    exact, each approximation's error and correlation with it are stored too).
    """
    ig_steps: int = 8
    """atp_ig: the points between the corrupted and the clean input (1: atp itself)."""

    @property
    def methods(self) -> tuple[str, ...]:
        return (self.method,) if isinstance(self.method, str) else tuple(self.method)


def parse_patching(raw: Mapping[str, Any] | None) -> PatchingConfig | None:
    """The read-only PatchingConfig of a `patching:` node (None when it is empty)."""
    if not raw:
        return None
    config = parse_typed(raw, PatchingConfig, "patching")
    check_choices("patching.sites", config.sites, SITE_KINDS, "a site kind")
    positions = config.positions
    if positions != "all":
        ints = isinstance(positions, list) and positions
        if not ints or not all(isinstance(p, int) and not isinstance(p, bool) for p in positions):
            raise HookrunError(
                f"patching.positions: {positions!r}; valid: all, or a list of token positions "
                "(0-based ints)"
            )
        if min(positions) < 0 or len(set(positions)) != len(positions):
            raise HookrunError(
                f"patching.positions: {list(positions)}; valid: distinct positions ≥ 0"
            )
    _check_layers(config.layer)
    check_range("patching.batch_size", config.batch_size, 1, allow_none=True)
    check_range("patching.memory_mib", config.memory_mib, 1)
    methods = [config.method] if isinstance(config.method, str) else config.method
    if not isinstance(methods, list | tuple) or not all(isinstance(m, str) for m in methods):
        raise HookrunError(
            f"patching.method: {config.method!r}; valid: {', '.join(METHODS)}, or a list of them"
        )
    if isinstance(config.method, str) and config.method not in METHODS:
        did = did_you_mean(config.method, METHODS)
        raise HookrunError(f"patching.method: {config.method!r}{did}; valid: {', '.join(METHODS)}")
    check_choices("patching.method", methods, METHODS, "a method")
    check_range("patching.ig_steps", config.ig_steps, 1)
    return freeze(config)


def _check_layers(layer: Any) -> None:
    """`patching.layer`: all, an int ≥ 0 or a list of distinct ones (the model's layer
    count is checked when the grid is planned)."""
    if layer == "all":
        return
    listed = layer if isinstance(layer, list) else [layer]
    ints = listed and all(isinstance(i, int) and not isinstance(i, bool) for i in listed)
    if not ints or min(listed) < 0 or len(set(listed)) != len(listed):
        raise HookrunError(
            f"patching.layer: {layer!r}; valid: all, a layer index (0-based) or a list of "
            "distinct ones"
        )


def chosen_layers(layer: Any, count: int) -> list[int]:
    """The layer indices `patching.layer` names, of a model with `count` layers."""
    if layer == "all":
        return list(range(count))
    listed = list(layer) if isinstance(layer, list | tuple) else [layer]
    if max(listed) >= count:
        raise HookrunError(
            f"patching.layer: {max(listed)} is past the model's {count} layers; valid: 0 to "
            f"{count - 1}, or all"
        )
    return sorted(listed)
