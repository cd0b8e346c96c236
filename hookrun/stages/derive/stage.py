"""The derived-methods stage (`derive:`): each method's results per batch, computed from the
batch's captures (or from passes of its own on the bare model), stored raw at
/derived/<method>/<layer or input>; the methods are a registry (registry.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import h5py
import numpy as np

from hookrun.errors import HookrunError
from hookrun.io import layout, walk
from hookrun.memory import check_fits
from hookrun.models.adapter import adapt
from hookrun.runtime.hooks import run_mode
from hookrun.runtime.targets import TargetConfig, TargetKind
from hookrun.stage import ParseContext, Plan, Setup, Stage, Stored, Work, register_stage
from hookrun.stages.derive.registry import METHODS, Derivation, derive, plan_derivations
from hookrun.typed import parse_typed

__all__ = ["DeriveStage", "parse_derive", "check_extra_passes", "AUTO"]

AUTO = "auto"  # a method's layer when model.cam_layer=auto (the probe picks it)


def parse_derive(raw: Any, target: TargetConfig, prefix: str = "derive") -> dict[str, Any]:
    """Method name → its parsed, checked Args, in the node's order; errors name
    `<prefix>.<method>.<key>` (the sanity check parses its methods' nodes here too)."""
    out = {}
    for name, node in (raw or {}).items():
        key = f"{prefix}.{name}"
        method = METHODS.get(name, key)
        args = parse_typed(node, method.Args, key)
        if hasattr(args, "layer") and not args.layer:
            raise HookrunError(
                f"{key}.layer: {node!r} names no layer; set model.cam_layer=NAME (the model "
                f"presets set it) or {key}.layer"
            )
        method.check(args, key)
        if method.runs_passes and target.kind == TargetKind.none:
            raise HookrunError(
                f"target.kind: 'none' gives {name} nothing to explain; valid: predicted, label, "
                "index, sum"
            )
        if method.needs_class and target.kind in (TargetKind.sum, TargetKind.none):
            raise HookrunError(
                f"target.kind: {target.kind.value!r} has no class for {name}; valid: predicted, "
                "label, index"
            )
        out[name] = args
    return out


def check_extra_passes(derive: Mapping[str, Any], rows: int, shape: tuple[int, ...]) -> None:
    """Refuse a method's extra pass (rows of perturbed copies) that cannot fit in memory:
    `rows` the batch's rows, `shape` one sample's (float32)."""
    sample = 4 * math.prod(shape)
    for name, args in derive.items():
        given = getattr(args, "internal_batch_size", None)
        if given:  # rows per extra pass; null sizes them to 32 MiB of input values
            each = getattr(args, "steps", None) or getattr(args, "samples", 1)
            extra = min(given, rows * each)
            what = f"one extra pass of {extra} x {list(shape)}"
            check_fits(f"derive.{name}.internal_batch_size", given, extra * sample, what)


def with_layer(derive: Mapping[str, Any], layer: str) -> Mapping[str, Any]:
    """`derive` with every `auto` layer set to `layer`."""
    from dataclasses import replace

    from hookrun.typed import freeze

    return MappingProxyType(
        {
            name: freeze(replace(args, layer=layer))
            if getattr(args, "layer", None) == AUTO
            else args
            for name, args in derive.items()
        }
    )


def says_auto(derive: Mapping[str, Any]) -> bool:
    return any(getattr(args, "layer", None) == AUTO for args in derive.values())


class DerivePlan(Plan):
    """The run's derived results, each method prepared on the model."""

    def __init__(self, derivations: list[Derivation], sample: tuple[int, ...]) -> None:
        self.derivations, self.sample = derivations, sample

    def stored(self) -> dict[str, Stored]:
        return {
            key: Stored(shape)
            for d in self.derivations
            for key, shape in d.stored_shapes(self.sample).items()
        }

    def shaped(self) -> dict[str, tuple[int, ...]]:
        """What a method explaining the input embeddings stores per row, (T, D): named as a
        capture of that shape is."""
        return {d.key: d.explained for d in self.derivations if d.explained}

    def batch(self, work: Work) -> dict[str, Any]:
        # The context inside: a language model's embeddings are computed with the run's
        # hooks standing aside, like the derived passes themselves.
        return derive(self.derivations, work.records, work.context())


@register_stage
class DeriveStage(Stage):
    name = node = "derive"
    node_after = "hooks"
    order = 10
    axes = {
        layout.gap_key("*", "*"): "sample",
        layout.derived_key("rise", "input"): "sample y x",  # a map over the image's pixels
        layout.derived_key("*", "input"): "sample {input}",
        layout.derived_key("guided_grad_cam", "*"): "sample {input}",
        layout.derived_key("*", "*"): "sample y x",
    }

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        derive = parse_derive(raw, ctx.target)
        if not derive:
            return None
        shape = getattr(ctx.dataset, "sample_shape", None)
        if shape is not None:  # a kind whose config gives its samples' shape
            rows = min(n for n in (ctx.batch_size, ctx.limit, getattr(ctx.dataset, "size", 0)) if n)
            check_extra_passes(derive, rows, shape())
        return derive

    @classmethod
    def says_auto(cls, config: Any) -> bool:
        return says_auto(config)

    @classmethod
    def resolve_layer(cls, config: Any, layer: str) -> Any:
        return with_layer(config, layer)

    @classmethod
    def needs_input_gradient(cls, config: Any) -> str | None:
        gradients = [name for name in config if not METHODS.get(name, "derive").tokens_ok]
        return f"derive: {', '.join(gradients)}" if gradients else None

    @classmethod
    def plan(cls, config: Any, setup: Setup) -> Plan | None:
        rows = min(n for n in (setup.spec.batch_size, len(setup.data)) if n)
        check_extra_passes(config, rows, tuple(setup.sample.shape))
        with run_mode(setup.model):
            explained = adapt(setup.model).explained_sample(setup.sample)
            derivations = plan_derivations(
                config, setup.captures, setup.model, setup.sample, explained
            )
        return DerivePlan(derivations, tuple(setup.sample.shape))

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        """The worst completeness gap of each result that has one (integrated gradients)."""
        found = [(m, k, ds) for m, group in walk.derived_of(f).items() for k, ds in group.items()]
        index = f[layout.SAMPLES_INDEX][:rows] if layout.SAMPLES_INDEX in f else np.arange(rows)
        return [
            _worst_gap(f"{m}/{k.removesuffix(layout.GAP_SUFFIX)}", ds[:rows], index)
            for m, k, ds in found
            if k.endswith(layout.GAP_SUFFIX)
        ]


def _worst_gap(name: str, gap: np.ndarray, index: np.ndarray) -> str:
    """`integrated_gradients/input: worst completeness gap ... (sample #i)`."""
    if not len(gap):
        return f"{name}: no rows"
    worst = int(np.abs(gap).argmax())
    return (
        f"{name}: worst completeness gap {float(gap[worst]):+.3g} (sample {int(index[worst])}; "
        "sum of attributions minus f(x) - f(baseline); more steps make it smaller)"
    )
