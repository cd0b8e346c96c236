"""Composites: which module gets which LRP rule, as per-selector rules.

A composite expands into rules given by hookrun's selector grammar (`select: {type: [...]}`,
`{name: ...}`), in order, the first that matches a module giving its rule — Zennit 0.5.1's
layer maps (`zennit/composites.py`): the first layer (the first convolution or linear
layer in the model's order) flat or z^B, activations pass, sums and average pools norm,
batch norms pass (merged into the layer before them by the canonizers), convolutions z⁺,
γ or α2β1, linear layers ε. Rules given in `derive.lrp.rules` come first, so a user's rule
for a module wins over the composite's. `assign` resolves the rules against a model and
refuses a layer with parameters that no rule covers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from hookrun.errors import HookrunError, did_you_mean
from hookrun.runtime.selectors import SelectConfig, select_layers
from hookrun.stages.derive.lrp.rules import Rule, RuleArgs, check_rule, make_rule
from hookrun.typed import Frozen, parse_typed

__all__ = [
    "ATTNLRP",
    "COMPOSITES",
    "RuleConfig",
    "Entry",
    "composite_entries",
    "user_entries",
    "assign",
]

# attnlrp: LXT 2.1's AttnLRP on language models (attnlrp.py), no layer map of Zennit's.
ATTNLRP = "attnlrp"
COMPOSITES = (
    "epsilon_plus_flat", "epsilon_gamma_box", "epsilon_alpha2_beta1", "epsilon_plus", ATTNLRP,
)  # fmt: skip

SUM_TYPE = "hookrun.stages.derive.lrp.canonize.Sum"
# Zennit's types.Activation, by torch.nn name.
ACTIVATIONS = [
    "ELU", "Hardshrink", "Hardsigmoid", "Hardtanh", "Hardswish", "LeakyReLU", "LogSigmoid",
    "MultiheadAttention", "PReLU", "ReLU", "ReLU6", "RReLU", "SELU", "CELU", "GELU", "Sigmoid",
    "SiLU", "Softplus", "Softshrink", "Softsign", "Tanh", "Tanhshrink", "Threshold",
]  # fmt: skip
AVG_POOLS = [
    "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
]  # fmt: skip
BATCH_NORMS = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]
CONVOLUTIONS = [
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
]  # fmt: skip
_CONV_TYPES = tuple(getattr(nn, n) for n in CONVOLUTIONS)
_LINEAR_TYPES = (*_CONV_TYPES, nn.Linear)


@dataclass
class RuleConfig(RuleArgs, Frozen):
    """One entry of `derive.lrp.rules`: the modules it selects and the rule they get (the
    rule's arguments and defaults are RuleArgs's)."""

    rule: str = ""
    """epsilon | zplus | gamma | alpha_beta | flat | wsquare | zbox | pass | norm"""
    select: SelectConfig = field(default_factory=SelectConfig)
    """Which modules (hookrun's selector grammar: name, regex, type, exclude)."""


@dataclass(frozen=True)
class Entry:
    """One rule of a run: its name, what it selects and the rule's arguments."""

    name: str
    select: SelectConfig
    args: RuleArgs
    given: bool  # written by the user (a selector that matches nothing is refused)

    def line(self) -> str:
        """`linears: type=[Linear] -> epsilon(epsilon=1e-06)`."""
        shown = ", ".join(
            f"{k}={v if isinstance(v, str) else list(v)}"
            for k, v in vars(self.select).items()
            if v is not None and not k.startswith("_")
        )
        return f"{self.name}: {shown} -> {make_rule(self.args).describe()}"


def _types(names: list[str]) -> SelectConfig:
    return SelectConfig(type=list(names))


def first_layer(model: nn.Module, convolutions_only: bool) -> str | None:
    """The first convolution (or linear layer) in the model's order, Zennit's first layer."""
    kinds = _CONV_TYPES if convolutions_only else _LINEAR_TYPES
    return next((n for n, m in model.named_modules() if n and isinstance(m, kinds)), None)


def composite_entries(
    composite: str, model: nn.Module, epsilon: float, stabilizer: float, gamma: float,
    low: Any, high: Any,
) -> list[Entry]:  # fmt: skip
    """The per-selector rules `composite` stands for on `model`, first match first."""

    def entry(name: str, select: SelectConfig, rule: str, **kw: Any) -> Entry:
        args = RuleArgs(rule, stabilizer=stabilizer, **kw)
        return Entry(f"{composite}.{name}", select, args, False)

    out = []
    box = composite == "epsilon_gamma_box"
    first = first_layer(model, convolutions_only=box)
    if composite in ("epsilon_plus_flat", "epsilon_gamma_box") and first is not None:
        if box:
            out.append(entry("first_layer", SelectConfig(name=first), "zbox", low=low, high=high))
        else:
            out.append(entry("first_layer", SelectConfig(name=first), "flat"))
    conv = {
        "epsilon_plus_flat": ("zplus", {}),
        "epsilon_plus": ("zplus", {}),
        "epsilon_gamma_box": ("gamma", {"gamma": gamma}),
        "epsilon_alpha2_beta1": ("alpha_beta", {"alpha": 2.0, "beta": 1.0}),
    }[composite]
    out += [
        entry("activations", _types(ACTIVATIONS), "pass"),
        entry("sums", _types([SUM_TYPE]), "norm"),
        entry("avg_pools", _types(AVG_POOLS), "norm"),
        entry("batch_norms", _types(BATCH_NORMS), "pass"),
        entry("convolutions", _types(CONVOLUTIONS), conv[0], **conv[1]),
        entry("linears", _types(["Linear"]), "epsilon", epsilon=epsilon),
    ]
    return out


def _thaw(value: Any) -> Any:
    """A frozen config node (read-only mappings, tuples) as plain dicts and lists again."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def user_entries(rules: Mapping[str, Any], key: str, low: Any, high: Any) -> list[Entry]:
    """`derive.lrp.rules` parsed and checked, in their order (a zbox's box defaults to the
    method's `low` / `high`)."""
    out = []
    for name, node in rules.items():
        where = f"{key}.{name}"
        node = _thaw(node)
        config = parse_typed(node, RuleConfig, where)
        if not any(getattr(config.select, k) for k in ("name", "regex", "type")):
            raise HookrunError(
                f"{where}.select: {node.get('select') if hasattr(node, 'get') else None!r} "
                "selects nothing; valid: a mapping with name, regex or type (as a hook's select)"
            )
        if config.select.function:
            raise HookrunError(
                f"{where}.select.function: {config.select.function!r}; valid: modules only "
                "(name, regex, type): an LRP rule stands on a module"
            )
        values = {f.name: getattr(config, f.name) for f in fields(RuleArgs)}
        if values["low"] is None:
            values["low"] = low
        if values["high"] is None:
            values["high"] = high
        args = RuleArgs(**values)
        check_rule(args, where)
        out.append(Entry(f"rules.{name}", config.select, args, True))
    return out


def check_composite(composite: Any, key: str) -> None:
    """Refuse a composite that is not one of COMPOSITES."""
    if composite not in COMPOSITES:
        raise HookrunError(
            f"{key}: {composite!r} is not an LRP composite; valid: {', '.join(COMPOSITES)}, or "
            f"null with derive.lrp.rules{did_you_mean(composite, COMPOSITES)}"
        )


def assign(model: nn.Module, entries: list[Entry], key: str) -> dict[str, tuple[str, Rule]]:
    """Module name → (the entry that chose it, its rule), first match wins; refuses a layer
    with parameters of its own that no entry covers, naming its path and type."""
    chosen: dict[str, tuple[str, Rule]] = {}
    for entry in entries:
        try:
            names = select_layers(entry.select, model, f"{key}.{entry.name}.select")
        except HookrunError:
            if entry.given:
                raise
            continue  # a composite's rule for a kind of layer the model has none of
        rule = make_rule(entry.args)
        for name in names:
            if name != "input":
                chosen.setdefault(name, (entry.name, rule))
    modules = dict(model.named_modules())
    for name, (entry_name, rule) in chosen.items():
        module = modules[name]
        if rule.weighted and not isinstance(getattr(module, "weight", None), nn.Parameter):
            raise HookrunError(
                f"{key}.{entry_name}: rule {rule.name!r} reads a layer's weight, and {name} "
                f"({type(module).__name__}) has none; valid there: pass, norm"
            )
    for name, module in model.named_modules():
        own = next(module.parameters(recurse=False), None) is not None
        leaf = next(module.children(), None) is None
        if own and leaf and name not in chosen:
            raise HookrunError(
                f"{key}: no rule covers {name} ({type(module).__name__}, a layer with "
                "parameters); valid: add one in derive.lrp.rules (e.g. {select: {name: "
                f"{name}}}, rule: pass}}), or a composite that covers "
                f"{type(module).__name__}"
            )
    return chosen
