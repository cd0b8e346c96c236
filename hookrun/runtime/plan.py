"""Config + model → HookPlan: every hook, every module it matched, in registration order.

The plan is data, not behaviour: `hooks.attach()` turns it into registrations, and
`describe()` prints it for `dry_run=true` with shapes measured by a one-sample probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from torch import nn

from hookrun.errors import HookrunError
from hookrun.io.layout import capture_key
from hookrun.models.adapter import adapt
from hookrun.runtime.actions import Action, Output
from hookrun.runtime.functions import resolve_words
from hookrun.runtime.hookspec import HookSpec
from hookrun.runtime.pattern import WORD, bind_pattern
from hookrun.runtime.positions import positions_shape
from hookrun.runtime.selectors import INPUT_LAYER, select_layers
from hookrun.runtime.sites import Site

__all__ = [
    "PlannedHook",
    "CallShapes",
    "Leaf",
    "HookPlan",
    "compile_plan",
    "check_reached",
    "bind_calls",
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
    # Names the selector gave literally (no glob): a user who names a module expects it to run.
    exact: tuple[str, ...] = ()
    # `select.function` words; the hook's layers are then the call sites the probe found
    # (`<module>/<word>.<k>`), inside the `within` modules when name/type/regex narrowed them.
    functions: tuple[str, ...] = ()
    within: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Leaf:
    """One floating-point tensor of a call, as the probe measured it (runtime/shape_probe.py): its
    name suffix (runtime/leaves.py), the shape of one stored row, and how its rows map to
    samples — `fold` 1: one row per sample; k > 1: k rows per sample folded into the batch
    axis, sample by sample (stored (N, k, ...)); 0: no batch axis (the whole tensor, stored
    once per batch). `refused`: why it cannot be stored ('' when it can)."""

    name: str
    shape: tuple[int, ...]
    fold: int = 1
    refused: str = ""


@dataclass(frozen=True)
class CallShapes:
    """The floating-point leaves of one call of a module, at its inputs and its outputs."""

    inputs: tuple[Leaf, ...]
    outputs: tuple[Leaf, ...]

    def at(self, site: Site) -> tuple[Leaf, ...]:
        return self.inputs if site in (Site.input, Site.grad_input) else self.outputs


def acts_on(hook: PlannedHook, leaf: int) -> bool:
    """Whether `hook` acts on the `leaf`-th floating-point tensor at its site. An action that
    changes values acts on the first input only: the one a module or function transforms;
    those after it are what it is told (a transformer block's additive attention mask, −3.4e38
    where masked: scaled, clamped or noised, it would unmask tokens; a linear's weight).
    Captures store every tensor; at other sites every hook acts on every tensor."""
    return leaf == 0 or hook.site != Site.input or not hook.action.changes


def acts_at_step(hook: PlannedHook, step: int) -> bool:
    """Whether `hook` acts at decoding step `step` of a generation (0: the prompt's pass, the
    run's own; after it one new token per row). A hook tied to the prompt's tokens — its
    `args.positions`, or stored rows put back (`patch`) — acts at the prompt's pass only
    (through the key-value cache every later token sees what it did: ActAdd's injection at
    the front positions); every other hook acts at every step."""
    return step == 0 or (hook.action.positions is None and not hook.action.reads_rows)


@dataclass
class HookPlan:
    """The ordered hooks of a run; file order is registration order."""

    hooks: list[PlannedHook] = field(default_factory=list)
    # Selected Linear/Conv modules that never run as modules but whose weight a function
    # call uses (found by the probe): their sites are those calls.
    weighted: tuple[str, ...] = ()
    # Lines the dry-run text shows above the hooks (e.g. attention switched to eager).
    notes: tuple[str, ...] = ()

    @property
    def words(self) -> tuple[str, ...]:
        """Every `select.function` word of the plan."""
        return tuple(dict.fromkeys(w for h in self.hooks for w in h.functions))

    @property
    def needs_calls(self) -> bool:
        """Whether forward passes need the function mode (hookrun/runtime/functions.py)."""
        return bool(self.words or self.weighted)

    @property
    def needs_backward(self) -> bool:
        return any(h.site.is_grad or h.action.needs_gradient for h in self.hooks)

    @property
    def backward_passes(self) -> list[str]:
        """The backward passes gradient hooks asked for (and actions that record a gradient
        of their own: the main pass), in file order."""
        wanted = (h.backward for h in self.hooks if h.site.is_grad or h.action.needs_gradient)
        return list(dict.fromkeys(wanted))

    @property
    def layers(self) -> list[str]:
        """Every real module the plan touches (the input pseudo-layer excluded), once."""
        seen: dict[str, None] = {}
        for hook in self.hooks:
            for layer in hook.layers:
                if layer != INPUT_LAYER:
                    seen[layer] = None
        return list(seen)

    def acting(self) -> HookPlan:
        """The plan of the hooks that change values (captures and gradient sites left out):
        what acts in a stage's own passes of the model (each decoding step, a second pass)."""
        keep = [h for h in self.hooks if h.action.changes and not h.site.is_grad]
        return dataclasses.replace(self, hooks=keep)

    def at(self, layer: str, site: Site) -> list[PlannedHook]:
        """The hooks acting at (layer, site), in file order."""
        return [h for h in self.hooks if h.site == site and layer in h.layers]

    def sites(
        self, shapes: Mapping[str, list[CallShapes]]
    ) -> Iterator[tuple[PlannedHook, str, Leaf]]:
        """(hook, capture path, leaf) of every tensor a hook acts on in the probe.

        A capture needs rows the probe could map to samples (or to batches): other leaves
        are refused, as are stored per-sample rows (`patch`) at a site without them.
        """
        for hook in self.hooks:
            for layer in hook.layers:
                for call, call_shapes in enumerate(shapes.get(layer, [])):
                    for i, leaf in enumerate(call_shapes.at(hook.site)):
                        if not acts_on(hook, i):
                            continue
                        key = capture_key(layer, hook.site, call, leaf=leaf.name)
                        if hook.action.records and leaf.refused:
                            raise HookrunError(
                                f"hooks.{hook.name}: /{key} cannot be stored row by row "
                                f"({leaf.refused}; shape {list(leaf.shape)} per sample or "
                                "batch); valid: leave it out with select.exclude, capture the "
                                "module around it, or act on it without capturing"
                            )
                        if hook.action.reads_rows and leaf.fold != 1:
                            raise HookrunError(
                                f"hooks.{hook.name}: /{key} {_rows_text(leaf)}, and "
                                f"{hook.action.name} puts stored rows in per sample; valid: a "
                                "site with one row per sample"
                            )
                        yield hook, key, leaf

    def site_outputs(
        self, shapes: Mapping[str, list[CallShapes]]
    ) -> Iterator[tuple[PlannedHook, str, Leaf, dict[str, Output]]]:
        """(hook, capture path, leaf, its outputs) of every site a recording hook acts on.

        An action that records for a site of pure rows only (`positions` pick before a
        non-changing action records; rows folded into the batch axis stay folded where the
        record keeps the site's shape): anything else is refused.
        """
        for hook, key, leaf in self.sites(shapes):
            if not hook.action.records:
                continue
            action, name = hook.action, f"hooks.{hook.name}"
            shape = leaf.shape
            if action.positions is not None and not action.changes:
                shape = positions_shape(action.positions, shape)
            outputs = action.outputs(shape, key, name)
            for path, output in outputs.items():
                if leaf.fold == 1 or output.shape == leaf.shape:
                    continue
                if path == key:
                    raise HookrunError(
                        f"{name}.args.pool: /{key} {_rows_text(leaf)}, not feature maps of one "
                        "sample; valid: null (store it whole)"
                    )
                raise HookrunError(
                    f"{name}: /{key} {_rows_text(leaf)}, and {action.name} records /{path} "
                    "per sample; valid: a site with one row per sample"
                )
            yield hook, key, leaf, outputs

    def outputs(self, shapes: Mapping[str, list[CallShapes]]) -> dict[str, Output]:
        """Every tensor the run's hooks record, by path, from a probe's shapes."""
        return {p: o for _, _, _, found in self.site_outputs(shapes) for p, o in found.items()}

    def capture_shapes(self, shapes: Mapping[str, list[CallShapes]]) -> dict[str, tuple[int, ...]]:
        """The shape of one row of every dense record (captures), from a probe's shapes."""
        return {p: o.shape for p, o in self.outputs(shapes).items() if not o.sparse}

    def folds(self, shapes: Mapping[str, list[CallShapes]]) -> dict[str, int]:
        """Record path → `Leaf.fold` of every record not stored one row per sample."""
        return {
            path: leaf.fold
            for _, _, leaf, found in self.site_outputs(shapes)
            if leaf.fold != 1
            for path in found
        }


def _rows_text(leaf: Leaf) -> str:
    if leaf.fold == 0:
        return "has no batch axis (it is stored once per batch)"
    return f"holds {leaf.fold} rows per sample folded into the batch axis"


def compile_plan(hooks: tuple[HookSpec, ...], model: nn.Module) -> HookPlan:
    """Resolve every hook's selector against `model`; raise HookrunError on any mismatch."""
    plan = HookPlan()
    captured: dict[tuple[str, Site, str], str] = {}
    for spec in hooks:
        name, action = spec.name, spec.action
        key = f"hooks.{name}"
        functions = tuple(_names(spec.select.function))
        if spec.action.heads is not None and (spec.at != Site.pattern or not action.changes):
            raise HookrunError(
                f"{key}.args.heads: {list(spec.action.heads)} with {action.name} at "
                f"{spec.at.value}; valid: heads only for zero, scale, patch, ... at: pattern"
            )
        if spec.at == Site.pattern:
            plan.hooks.append(_pattern_hook(spec, model))
            action.bind(model, plan.hooks[-1].within or (), spec.at, key)
            _claim(captured, spec, plan.hooks[-1].within or ())
            note = adapt(model).use_eager()
            plan.notes += (note,) if note else ()
            continue
        if functions:
            resolve_words(list(functions), f"{key}.select.function")
            narrowed = any((spec.select.name, spec.select.regex, spec.select.type))
            within = tuple(select_layers(spec.select, model, f"{key}.select")) if narrowed else None
            if within is not None and INPUT_LAYER in within:
                raise HookrunError(f"{key}.select.name: 'input' runs no functions; valid: modules")
            action.bind(model, (), spec.at, key)  # call sites are known after the probe
            site = PlannedHook(name, spec.at, action, (), spec.backward, (), functions, within)
            plan.hooks.append(site)
            continue
        placed = action.place(model, spec.at, key) if _selects_nothing(spec) else None
        if placed is not None:  # a dictionary at the module its hook name says
            _claim(captured, spec, placed)
            plan.hooks.append(PlannedHook(name, spec.at, action, placed, spec.backward, placed))
            continue
        try:
            layers = tuple(select_layers(spec.select, model, f"{key}.select"))
        except HookrunError:
            # A module selector next to a function selector of the same rule (guided_bp on a
            # model of functional activations only) may match nothing; check_reached decides.
            if not any(_same_rule(spec, other) and other.select.function for other in hooks):
                raise
            layers = ()
        if INPUT_LAYER in layers and spec.at not in INPUT_LAYER_SITES:
            raise HookrunError(
                f"{key}.at: {spec.at.value!r} does not exist on the model-input pseudo-layer "
                f"'input'; valid: {', '.join(s.value for s in INPUT_LAYER_SITES)}"
            )
        _claim(captured, spec, layers)
        action.bind(model, layers, spec.at, key)
        exact = tuple(n for n in _names(spec.select.name) if n != INPUT_LAYER and _literal(n))
        plan.hooks.append(PlannedHook(name, spec.at, action, layers, spec.backward, exact))
    return plan


def _claim(captured: dict[tuple[str, Site, str], str], spec: HookSpec, layers: tuple) -> None:
    """Refuse a second record of one kind (`Action.claims`) at one (module, site)."""
    for layer in layers:
        for kind in spec.action.claims():
            other = captured.setdefault((layer, spec.at, kind), spec.name)
            if other == spec.name:
                continue
            what = "captures" if kind == "capture" else f"records {kind} at"
            raise HookrunError(
                f"hooks.{spec.name}: {what} {layer}/{spec.at.value}, which hooks.{other} "
                f"already {what.split()[0]}; keep one of them"
            )


def _pattern_hook(spec: HookSpec, model: nn.Module) -> PlannedHook:
    """A pattern site: the softmax calls inside the selected modules (runtime/pattern.py)."""
    key = f"hooks.{spec.name}"
    if spec.select.function:
        raise HookrunError(
            f"{key}.select.function: {spec.select.function!r} with at: pattern; valid: "
            "select the attention modules by name, regex or type"
        )
    if spec.action.positions is not None:
        raise HookrunError(
            f"{key}.args.positions: {spec.action.positions.describe()} at pattern, which holds "
            "every query and key position; valid: null (the whole pattern)"
        )
    layers = tuple(select_layers(spec.select, model, f"{key}.select"))
    if INPUT_LAYER in layers:
        raise HookrunError(f"{key}.select.name: 'input' has no attention pattern; valid: modules")
    exact = tuple(n for n in _names(spec.select.name) if _literal(n))
    return PlannedHook(
        spec.name, Site.pattern, spec.action, (), spec.backward, exact, (WORD,), layers
    )


def _check_heads(
    hook: PlannedHook, calls: tuple[str, ...], shapes: Mapping[str, list[CallShapes]]
) -> None:
    """Refuse `args.heads` past the heads of a bound pattern site."""
    for call in calls if hook.action.heads else ():
        for leaf in (c for shaped in shapes.get(call, []) for c in shaped.outputs):
            count = leaf.shape[0] if leaf.shape else 0
            if max(hook.action.heads) >= count:
                raise HookrunError(
                    f"hooks.{hook.name}.args.heads: {max(hook.action.heads)} is past the "
                    f"{count} heads of {call.rsplit('/', 1)[0]}; valid: 0..{count - 1}"
                )


def bind_calls(plan: HookPlan, shapes: Mapping[str, list[CallShapes]]) -> HookPlan:
    """The plan with each function hook's layers set to the call sites the probe found, and
    the selected modules that ran only through their weights marked as such."""
    calls = [name for name in shapes if "/" in name]
    hooks = []
    for hook in plan.hooks:
        if hook.site == Site.pattern:
            found = bind_pattern(f"hooks.{hook.name}", hook.within or (), hook.exact, calls)
            _check_heads(hook, found, shapes)
            hook = dataclasses.replace(hook, layers=found)
        elif hook.functions:
            found = tuple(
                name
                for name in calls
                if name.rsplit("/", 1)[1].rsplit(".", 1)[0] in hook.functions
                and (hook.within is None or name.rsplit("/", 1)[0] in hook.within)
            )
            hook = dataclasses.replace(hook, layers=found)
        hooks.append(hook)
    return dataclasses.replace(plan, hooks=hooks)


def _selects_nothing(spec: HookSpec) -> bool:
    select = spec.select
    return not any((select.name, select.regex, select.type, select.function))


def _names(value: object) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _literal(pattern: str) -> bool:
    return not any(c in pattern for c in "*?[")


def _rule(hook: HookSpec | PlannedHook) -> tuple:
    site = hook.at if isinstance(hook, HookSpec) else hook.site
    return site, hook.backward, hook.action.describe(), hook.action.records


def _same_rule(spec: HookSpec, other: HookSpec) -> bool:
    """Two hooks applying one rule (same site, pass, action and args; recording nothing), as
    guided_bp's module and function hooks do."""
    return other is not spec and not spec.action.records and _rule(other) == _rule(spec)


def _companion(hook: PlannedHook, other: PlannedHook) -> bool:
    same = not hook.action.records and _rule(other) == _rule(hook)
    return other is not hook and same and bool(other.layers)


def _reached(hook: PlannedHook, layer: str, shapes: Mapping[str, list[CallShapes]]) -> bool:
    """Whether a probe call of `layer` had a floating-point tensor at the hook's site (a
    gradient site needs one to carry a gradient)."""
    if layer == INPUT_LAYER:
        return True
    return any(call.at(hook.site) for call in shapes.get(layer, []))


def check_reached(
    plan: HookPlan, shapes: Mapping[str, list[CallShapes]]
) -> tuple[HookPlan, dict[str, list[str]]]:
    """Refuse a hook that would never act: a module named exactly that never runs, or a
    selection none of whose modules runs with a floating-point tensor at the site (a guided
    clamp that touches nothing would silently give the plain gradient). Returns the plan
    without the glob/type/regex matches a capture cannot store (no per-sample first axis,
    as Swin's qkv calls on windows) and, per hook, those and the matches that never ran
    (listed in the summary and the file)."""
    plan, unstored = _drop_unstorable(plan, shapes)
    idle: dict[str, list[str]] = {}
    for hook in plan.hooks:
        key = f"hooks.{hook.name}"
        if not hook.layers:
            # Guided Backprop's function hook finds nothing on a model of nn modules only:
            # fine while a hook with the same action acts in the same pass.
            if not any(_companion(hook, other) for other in plan.hooks):
                what = (
                    f"select.function: {list(hook.functions)} is never called inside forward "
                    "(outside built-in leaf modules, which are module sites)"
                    if hook.functions
                    else "select: matches no module of the model"
                )
                raise HookrunError(
                    f"{key}.{what}, and no other hook applies the same rule; valid: a "
                    "function the model calls, or modules it has (see dry_run=true)"
                )
            continue  # the other hook of the same rule acts: nothing is missing
        missing = [layer for layer in hook.layers if not _reached(hook, layer, shapes)]
        named = [layer for layer in missing if layer in hook.exact]
        if named:
            raise HookrunError(
                f"{key}.select.name: {named[0]!r} never runs with a floating-point tensor at "
                f"{hook.site.value} in a forward pass of this model (its weights may be used "
                "by another module's function call); valid: a module that runs, see dry_run=true"
            )
        if missing and len(missing) == len(hook.layers):
            shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
            raise HookrunError(
                f"{key}.select: every matched module ({shown}) never runs with a "
                f"floating-point tensor at {hook.site.value}, so this hook would act on "
                "nothing; valid: select modules that run in forward (see dry_run=true)"
            )
        missing += unstored.get(hook.name, [])
        if missing:
            idle[hook.name] = missing
    return plan, idle


def _drop_unstorable(
    plan: HookPlan, shapes: Mapping[str, list[CallShapes]]
) -> tuple[HookPlan, dict[str, list[str]]]:
    """Capture hooks without the layers (matched by glob/type/regex, not named exactly)
    whose tensors at the site cannot be stored row by row, and per hook 'layer (why)' of
    each; capture_shapes refuses the exactly named ones."""
    hooks, dropped = [], {}
    for hook in plan.hooks:
        bad = {}
        for layer in hook.layers:
            calls = shapes.get(layer, []) if hook.action.records else []
            why = [leaf.refused for c in calls for leaf in c.at(hook.site) if leaf.refused]
            if why and layer not in hook.exact:
                bad[layer] = f"{layer} (not stored: {why[0]})"
        if bad and len(bad) < len(hook.layers):
            hook = dataclasses.replace(hook, layers=tuple(x for x in hook.layers if x not in bad))
            dropped[hook.name] = list(bad.values())
        hooks.append(hook)
    return dataclasses.replace(plan, hooks=hooks), dropped
