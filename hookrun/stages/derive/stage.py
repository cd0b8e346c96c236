"""The derived-methods stage (`derive:`): each method's results per batch, computed from the
batch's captures (or from passes of its own on the bare model), stored raw at
/derived/<method>/<layer or input>; the methods are a registry (registry.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import h5py
import numpy as np

from hookrun.errors import HookrunError
from hookrun.io import layout, walk
from hookrun.models.adapter import adapt
from hookrun.runtime.hooks import run_mode
from hookrun.runtime.targets import TargetConfig, TargetKind
from hookrun.stage import ParseContext, Plan, Setup, Stage, Stored, Work, register_stage
from hookrun.stages.derive.bounds import check_pass_rows
from hookrun.stages.derive.registry import (
    METHODS,
    Derivation,
    Method,
    derive,
    plan_derivations,
)
from hookrun.stages.derive.rise import CELLS_KEY, SHIFTS_KEY
from hookrun.stages.derive.segments import segments_key
from hookrun.typed import parse_typed

__all__ = ["DeriveStage", "parse_derive", "check_extra_passes", "AUTO"]

AUTO = "auto"  # a method's layer when model.cam_layer=auto (the probe picks it)


def method_schemas(prefix: str) -> dict[str, type]:
    """The `Args` of every registered method, by its key under `prefix` (`derive`, or the
    sanity check's `sanity.derive`): what parse_derive merges each method's node into."""
    return {f"{prefix}.{name}": method.Args for name, method in METHODS.items()}


def parse_derive(
    raw: Any, target: TargetConfig, prefix: str = "derive", dataset: Any = None
) -> dict[str, Any]:
    """Method name → its parsed, checked Args, in the node's order; errors name
    `<prefix>.<method>.<key>` (the sanity check parses its methods' nodes here too);
    `dataset`, the parsed dataset config, completes what a method takes from it."""
    out = {}
    for name, node in (raw or {}).items():
        key = f"{prefix}.{name}"
        method = METHODS.get(name, key)
        args = method.complete(parse_typed(node, method.Args, key), dataset)
        if hasattr(args, "layer") and not args.layer:
            raise HookrunError(
                f"{key}.layer: {node!r} names no layer; set model.cam_layer=NAME (the model "
                f"presets set it) or {key}.layer"
            )
        method.check(args, key)
        if method.runs_passes and method.needs_target and target.kind == TargetKind.none:
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
    """At config time, where the dataset says its samples' shape: refuse a method's extra pass
    (`internal_batch_size` rows) that cannot fit in memory, `rows` the batch's rows, `shape`
    one sample's (float32); the counts that need the model are checked again at plan time."""
    for name, args in derive.items():
        each, row = METHODS.get(name, "derive").extra_rows(args, None, shape)
        given = getattr(args, "internal_batch_size", None)
        check_pass_rows(f"derive.{name}", given, rows, each, row)


def check_derivations(derivations: list[Derivation], rows: int, sample: tuple[int, ...]) -> None:
    """At plan time: each method's extra pass and what else a batch of `rows` makes it
    allocate at once, against the machine's memory (`sample`: the model input's shape)."""
    for d in derivations:
        shape = d.explained if d.explained is not None else sample
        each, row = d.method.extra_rows(d.args, d.state, shape)
        key = f"derive.{d.method.name}"
        check_pass_rows(key, getattr(d.args, "internal_batch_size", None), rows, each, row)
        d.method.check_sizes(d.args, d.state, rows, shape)


def refuse_token_data(derive: Mapping[str, Any]) -> None:
    """Refuse, on token data, a method that runs the model on perturbed images (one line:
    what it perturbs, and the methods that do take token data)."""
    for name in derive:
        method = METHODS.get(name, "derive")
        if method.perturbs:
            valid = ", ".join(n for n in METHODS.choices() if METHODS.get(n, "derive").tokens_ok)
            raise HookrunError(
                f"derive.{name}: {method.perturbs}, and token data has no pixels (its input is "
                f"token ids); valid: image data (C, H, W) with an image classifier, or on "
                f"token data {valid}"
            )


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

    def describe(self, itemsize: int) -> str:
        """Its datasets, then what each method says it applies where (LRP's rules)."""
        lines = [super().describe(itemsize)]
        lines += [line for d in self.derivations for line in d.method.describe(d.args, d.state)]
        return "\n".join(line for line in lines if line)

    def reads(self) -> frozenset[str]:
        """Every capture a method computes from: the run's own tensors, not the file's."""
        return frozenset(
            key
            for d in self.derivations
            for key in (*d.method.requires(d.args), *d.method.requires_prepared(d.args, d.state))
        )

    def gives_output(self) -> bool:
        """One method alone, whose pass forwards the batch as the model does (AttnLRP)."""
        if len(self.derivations) != 1:
            return False
        d = self.derivations[0]
        return d.method.gives_output(d.args, d.state)

    def batch(self, work: Work) -> dict[str, Any]:
        # The context inside: a language model's embeddings are computed with the run's
        # hooks standing aside, like the derived passes themselves.
        return derive(self.derivations, work.tensors, work.context())


@register_stage
class DeriveStage(Stage):
    name = node = "derive"
    node_after = "hooks"
    order = 10
    axes = {
        layout.gap_key("*", "*"): "sample",
        segments_key("*"): "sample y x",  # each pixel's segment
        CELLS_KEY: "sample mask cell_y cell_x",
        SHIFTS_KEY: "sample mask yx",
        layout.derived_key("rise", "input"): "sample y x",  # a map over the image's pixels
        # A ViT's patch grid, or a language model's tokens: told apart by their rank.
        layout.derived_key("attention_rollout", "input"): "sample y x|sample token",
        layout.derived_key("*", "input"): "sample {input}",
        layout.derived_key("guided_grad_cam", "*"): "sample {input}",
        layout.derived_key("*", "*"): "sample y x",
    }

    # What the perturbation methods perturbed: no maps (neither drawn nor evaluated as one).
    draws = (segments_key("*"), CELLS_KEY, SHIFTS_KEY)

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return method_schemas("derive")

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        derive = parse_derive(raw, ctx.target, dataset=ctx.dataset)
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
        # Asked on token data only, before the model's first pass (pipeline/tokencheck.py):
        # the perturbation methods need no gradient, so they are refused here for what they
        # do need (images), before `model.cam_layer=auto` would probe the model for a grid.
        refuse_token_data(config)
        gradients = [name for name in config if not METHODS.get(name, "derive").tokens_ok]
        return f"derive: {', '.join(gradients)}" if gradients else None

    @classmethod
    def plan(cls, config: Any, setup: Setup) -> Plan | None:
        rows = min(n for n in (setup.spec.batch_size, len(setup.data)) if n)
        with run_mode(setup.model):
            explained = adapt(setup.model).explained_sample(setup.sample)
            derivations = plan_derivations(
                config, setup.captures, setup.model, setup.sample, explained
            )
        check_derivations(derivations, rows, tuple(setup.sample.shape))
        return DerivePlan(derivations, tuple(setup.sample.shape))

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
        from hookrun.stages.derive.draw import draw_perturbations  # the pictures' libraries

        return draw_perturbations(f, out_dir, rows, config)

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        """The worst completeness gap of each result that has one (integrated gradients,
        KernelSHAP), and what makes it smaller."""
        found = [(m, k, ds) for m, group in walk.derived_of(f).items() for k, ds in group.items()]
        index = f[layout.SAMPLES_INDEX][:rows] if layout.SAMPLES_INDEX in f else np.arange(rows)
        return [
            _worst_gap(f"{m}/{k.removesuffix(layout.GAP_SUFFIX)}", ds[:rows], index, *_gap_words(m))
            for m, k, ds in found
            if k.endswith(layout.GAP_SUFFIX)
        ]


def _gap_words(method: str) -> tuple[str, str]:
    """What the method says makes its gap smaller, and what its gap is (a file's method may
    be unknown here)."""
    if method not in METHODS:
        return "", Method.gap_meaning
    found = METHODS.get(method, "derive")
    return found.gap_note, found.gap_meaning


def _worst_gap(
    name: str, gap: np.ndarray, index: np.ndarray, note: str, meaning: str = Method.gap_meaning
) -> str:
    """`integrated_gradients/input: worst completeness gap ... (sample #i; ...)`."""
    if not len(gap):
        return f"{name}: no rows"
    worst = int(np.abs(gap).argmax())
    return (
        f"{name}: worst completeness gap {float(gap[worst]):+.3g} (sample {int(index[worst])}; "
        f"{meaning}{'; ' + note if note else ''})"
    )
