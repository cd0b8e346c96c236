"""Config + model → HookPlan: every hook, every module it matched, in registration order.

The plan is data, not behaviour: `hooks.attach()` turns it into registrations, and
`describe()` prints it for `dry_run=true` with shapes measured by a one-sample probe.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from torch import nn

from hookrun.engine.actions import Action
from hookrun.engine.selectors import INPUT_LAYER, select_layers
from hookrun.errors import HookrunError
from hookrun.io.layout import capture_key
from hookrun.spec.build import HookSpec
from hookrun.spec.schema import Site

__all__ = [
    "PlannedHook",
    "CallShapes",
    "HookPlan",
    "compile_plan",
    "format_bytes",
]

# Sites the model-input pseudo-layer has: its output is the batch, its grad_output the
# input gradient. It has no input of its own.
INPUT_LAYER_SITES = (Site.output, Site.grad_output)


@dataclass(frozen=True)
class PlannedHook:
    """One hook of the config, with the modules its selector matched."""

    name: str
    site: Site
    action: Action
    layers: tuple[str, ...]
    backward: str = "main"


@dataclass(frozen=True)
class CallShapes:
    """Per-sample shapes of the floating-point tensors of one call of a module."""

    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]

    def at(self, site: Site) -> tuple[tuple[int, ...], ...]:
        return self.inputs if site in (Site.input, Site.grad_input) else self.outputs


def format_bytes(n: float) -> str:
    """1536 → '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass
class HookPlan:
    """The ordered hooks of a run; file order is registration order."""

    hooks: list[PlannedHook] = field(default_factory=list)

    @property
    def needs_backward(self) -> bool:
        return any(h.site.is_grad for h in self.hooks)

    @property
    def backward_passes(self) -> list[str]:
        """The backward passes gradient hooks asked for, in file order."""
        return list(dict.fromkeys(h.backward for h in self.hooks if h.site.is_grad))

    @property
    def layers(self) -> list[str]:
        """Every real module the plan touches (the input pseudo-layer excluded), once."""
        seen: dict[str, None] = {}
        for hook in self.hooks:
            for layer in hook.layers:
                if layer != INPUT_LAYER:
                    seen[layer] = None
        return list(seen)

    def at(self, layer: str, site: Site) -> list[PlannedHook]:
        """The hooks acting at (layer, site), in file order."""
        return [h for h in self.hooks if h.site == site and layer in h.layers]

    def sites(
        self, shapes: Mapping[str, list[CallShapes]]
    ) -> Iterator[tuple[PlannedHook, str, tuple[int, ...]]]:
        """(hook, capture path, per-sample shape) of every tensor a hook acts on in the probe."""
        for hook in self.hooks:
            for layer in hook.layers:
                for call, call_shapes in enumerate(shapes.get(layer, [])):
                    tensors = call_shapes.at(hook.site)
                    for i, shape in enumerate(tensors):
                        yield hook, capture_key(layer, hook.site, call, i, len(tensors)), shape

    def capture_shapes(self, shapes: Mapping[str, list[CallShapes]]) -> dict[str, tuple[int, ...]]:
        """Per-sample shape of every capture dataset, from a probe's shapes."""
        return {
            key: hook.action.stored_shape(shape, f"hooks.{hook.name}")
            for hook, key, shape in self.sites(shapes)
            if hook.action.captures
        }

    def describe(
        self,
        shapes: Mapping[str, list[CallShapes]],
        output_shape: tuple[int, ...],
        samples: int,
        itemsize: int,
        target: str,
    ) -> str:
        """The dry-run text: hooks → modules, shapes, bytes per sample, estimated file size."""
        backward = f"yes, from target.kind={target}" if self.needs_backward else "no"
        lines = [f"HookPlan: {len(self.hooks)} hook(s); backward pass: {backward}"]
        stored = self.capture_shapes(shapes)
        for hook in self.hooks:
            in_pass = f" (backward pass {hook.backward})" if len(self.backward_passes) > 1 else ""
            if not hook.site.is_grad:
                in_pass = ""
            lines.append(f"  {hook.name}: {hook.action.describe()} at {hook.site.value}{in_pass}")
            for layer in hook.layers:
                for call, call_shapes in enumerate(shapes.get(layer, [])):
                    tensors = call_shapes.at(hook.site)
                    for i, shape in enumerate(tensors):
                        key = capture_key(layer, hook.site, call, i, len(tensors))
                        if hook.action.captures:
                            shape = stored[key]
                        size = math.prod(shape) * itemsize
                        where = f"/{key}" if hook.action.captures else "(not stored)"
                        label = f"{layer} (call {call})" if call else layer
                        lines.append(
                            f"    {label:<32} {str(list(shape)):<20} "
                            f"{format_bytes(size):>11}/sample  {where}"
                        )
                if not shapes.get(layer):
                    lines.append(f"    {layer:<32} (not called in the probe forward pass)")
        per_sample = sum(math.prod(s) for s in stored.values()) * itemsize
        per_sample += math.prod(output_shape) * itemsize + 3 * 8  # output; index/label/target
        lines.append(
            f"Stored per sample: {format_bytes(per_sample)} (captures and /model/output "
            f"{list(output_shape)}); {samples} sample(s) → estimated file size "
            f"{format_bytes(per_sample * samples)} before compression"
        )
        return "\n".join(lines)


def compile_plan(hooks: tuple[HookSpec, ...], model: nn.Module) -> HookPlan:
    """Resolve every hook's selector against `model`; raise HookrunError on any mismatch."""
    plan = HookPlan()
    captured: dict[tuple[str, Site], str] = {}
    for spec in hooks:
        name, action = spec.name, spec.action
        key = f"hooks.{name}"
        layers = tuple(select_layers(spec.select, model, f"{key}.select"))
        if INPUT_LAYER in layers and spec.at not in INPUT_LAYER_SITES:
            raise HookrunError(
                f"{key}.at: {spec.at.value!r} does not exist on the model-input pseudo-layer "
                f"'input'; valid: {', '.join(s.value for s in INPUT_LAYER_SITES)}"
            )
        if action.captures:
            for layer in layers:
                other = captured.setdefault((layer, spec.at), name)
                if other != name:
                    raise HookrunError(
                        f"{key}: captures {layer}/{spec.at.value}, which hooks.{other} "
                        "already captures; keep one of them"
                    )
        plan.hooks.append(PlannedHook(name, spec.at, action, layers, spec.backward))
    return plan
