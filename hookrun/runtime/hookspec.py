"""A hook of the config: its `hooks.<name>:` node (HookConfig, merged and checked by the
config) and the HookSpec the plan is compiled from, its action built and checked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from hookrun.errors import HookrunError
from hookrun.runtime.actions import Action, build_action
from hookrun.runtime.selectors import SelectConfig
from hookrun.runtime.sites import Site
from hookrun.typed import Frozen, freeze

__all__ = ["HookConfig", "HookSpec", "AUTO", "says_auto", "with_layer"]


@dataclass
class HookConfig(Frozen):
    select: SelectConfig = field(default_factory=SelectConfig)
    at: Site = MISSING
    """The site the hook acts at: a module's input or output, or the gradient of either."""
    action: str = MISSING
    """What the hook does there (its arguments under `args`)."""
    args: dict[str, Any] = field(default_factory=dict)
    backward: str = "main"
    """The backward pass a gradient-site hook acts in. Passes share one forward pass and never see
    each other's changes: guided_grad_cam takes plain gradients at the CAM layer in pass `main`
    and Guided Backprop's clamped ones at the input in pass `guided`.
    """


@dataclass(frozen=True)
class HookSpec:
    """One entry of `hooks:`, with its action built and checked."""

    name: str
    select: SelectConfig
    at: Site
    action: Action
    backward: str = "main"

    @classmethod
    def from_config(cls, name: str, cfg: HookConfig) -> HookSpec:
        """The spec of hook `name`; its action and args checked (errors name hooks.<name>)."""
        key = f"hooks.{name}"
        action = build_action(cfg.action, cfg.args, key)
        if cfg.backward != "main" and not cfg.at.is_grad:
            raise HookrunError(
                f"{key}.backward: {cfg.backward!r} on a forward site ({cfg.at.value}); "
                "only grad_input and grad_output hooks belong to a backward pass"
            )
        return cls(name, cfg.select, cfg.at, action, cfg.backward)


AUTO = "auto"  # a selector's name when model.cam_layer=auto: the probe picks the module


def says_auto(hooks: tuple[HookSpec, ...]) -> bool:
    """Whether a hook selects the auto-picked layer."""
    return any(h.select.name == AUTO for h in hooks)


def with_layer(hooks: tuple[HookSpec, ...], layer: str) -> tuple[HookSpec, ...]:
    """`hooks` with every `auto` selector set to `layer` (new specs; these are frozen)."""
    return tuple(
        dataclasses.replace(h, select=freeze(dataclasses.replace(h.select, name=layer)))
        if h.select.name == AUTO
        else h
        for h in hooks
    )
