"""Layer-wise relevance propagation (Bach et al. 2015; Montavon et al. 2019) as hook rules:
`derive.lrp`, the relevance of each input value for the target score, by Zennit 0.5.1's
scheme — one forward pass and one backward pass in which every module with a rule hands
back its rule's relevance in place of its gradient (attach.py), on the model canonized
(canonize.py) for the pass and put back bit for bit after it.

The relevance at the output is the output times the score's gradient: for a target logit,
Zennit's one-hot × logit (`Gradient(attr_output=...)`), whose sum is the logit itself.

On a language model, `composite: attnlrp` (attnlrp.py): LXT 2.1's efficient AttnLRP, the
relevance of each input embedding value as Gradient × Input with the rules' changed
gradients, stored (N, T, D) as integrated gradients stores its attribution (the token
picture sums it over D); the relevance at the output is the target score itself.

`derive.lrp`: composite (epsilon_plus_flat | epsilon_gamma_box | epsilon_alpha2_beta1 |
epsilon_plus | attnlrp | null), epsilon, stabilizer, gamma, low / high (the first layer's box for
epsilon_gamma_box: null takes the images of pixel values 0 and 1 under the dataset's
mean/std), rules (per-selector rules ahead of the composite's), canonize.

Results: /derived/lrp/input (the input's shape) and each row's conservation gap, the input
relevance summed minus the output relevance, at /derived/lrp/input.completeness_gap (as
integrated gradients stores its completeness gap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.runtime.handles import hooked
from hookrun.stages.derive.lrp.attach import rule_hooks
from hookrun.stages.derive.lrp.attnlrp import AttnSites, attnlrp_hooks, attnlrp_sites
from hookrun.stages.derive.lrp.canonize import canonized
from hookrun.stages.derive.lrp.composites import (
    ATTNLRP,
    Entry,
    assign,
    check_composite,
    composite_entries,
    user_entries,
)
from hookrun.stages.derive.lrp.rules import Rule, RuleArgs, check_rule
from hookrun.stages.derive.registry import BatchContext, Method, register_method
from hookrun.typed import Frozen

__all__ = ["LRP", "LRPArgs", "LRPState", "box_of"]

KEY = "derive.lrp"


@dataclass
class LRPArgs(Frozen):
    composite: str | None = "epsilon_plus_flat"
    """epsilon_plus_flat | epsilon_gamma_box | epsilon_alpha2_beta1 | epsilon_plus (Zennit's
    layer maps), attnlrp (LXT 2.1's AttnLRP on a GPT-2, Llama, Qwen2 or Gemma 3 language model), or
    null: derive.lrp.rules alone.
    """
    epsilon: float = 1e-6
    """The composite's ε for linear layers (> 0)."""
    stabilizer: float = 1e-6
    """The composite's other rules: what keeps each denominator off zero (> 0)."""
    gamma: float = 0.25
    """epsilon_gamma_box: the convolutions' γ (>= 0)."""
    low: Any = None
    """epsilon_gamma_box: the first layer's box, lowest input value (a number or one per
    channel); null: the image of pixel value 0 under the dataset's mean/std.
    """
    high: Any = None
    """The box's highest input value; null: the image of pixel value 1."""
    rules: dict[str, Any] = field(default_factory=dict)
    """Per-selector rules ahead of the composite's, by name: {select: {type: [...]} or
    {name: ...}, rule: epsilon | zplus | gamma | alpha_beta | flat | wsquare | zbox | pass |
    norm, and its arguments: epsilon, stabilizer, gamma, alpha, beta, low, high}.
    """
    canonize: bool = True
    """Merge each batch norm into the layer before it for the pass (ResNet's residual sums
    are made explicit either way).
    """


@dataclass(frozen=True)
class LRPState:
    """The rules resolved on the run's model (module name → its rule) and the plan's lines."""

    rules: dict[str, Rule]
    lines: tuple[str, ...]
    sites: AttnSites | None = None  # composite attnlrp: where its rules stand


def box_of(dataset: Any) -> tuple[list[float] | None, list[float] | None]:
    """The images of pixel values 0 and 1 under the dataset's mean/std (None without)."""
    mean, std = getattr(dataset, "mean", None), getattr(dataset, "std", None)
    if not mean or not std or len(mean) != len(std):
        return None, None
    return [(0 - m) / s for m, s in zip(mean, std, strict=True)], [
        (1 - m) / s for m, s in zip(mean, std, strict=True)
    ]


def _fewer(done: list[str], shown: int = 3) -> list[str]:
    """The canonizers' lines, each kind's first `shown` and a count of the rest."""
    out: list[str] = []
    for kind in ("merged into", "residual sum"):
        lines = [line for line in done if kind in line]
        out += lines[:shown]
        if len(lines) > shown:
            out.append(f"… and {len(lines) - shown} more ({kind})")
    return out


def _entries(args: LRPArgs, model: nn.Module | None) -> list[Entry]:
    given = user_entries(args.rules or {}, f"{KEY}.rules", args.low, args.high)
    if args.composite is None or model is None:
        return given
    return given + composite_entries(
        args.composite, model, args.epsilon, args.stabilizer, args.gamma, args.low, args.high
    )


@register_method("lrp")
class LRP(Method):
    Args = LRPArgs
    runs_passes = True
    # On token data (composite attnlrp): the input embeddings, results (N, T, D).
    tokens_ok = explains_input = True
    gap_note = "biases, epsilon and the stabilisers absorb relevance"
    gap_meaning = "input relevance summed minus the output relevance"

    @classmethod
    def complete(cls, args: LRPArgs, dataset: Any) -> LRPArgs:
        """A null box from the dataset's normalisation."""
        low, high = box_of(dataset)
        if args.low is None and args.high is None and low is not None:
            return replace(args, low=low, high=high)
        return args

    @classmethod
    def check(cls, args: LRPArgs, key: str) -> None:
        if args.composite is not None:
            check_composite(args.composite, f"{key}.composite")
        elif not args.rules:
            raise HookrunError(
                f"{key}.composite: null with no {key}.rules gives no module a rule; valid: "
                "a composite, or rules per selector"
            )
        for name in ("epsilon", "stabilizer", "gamma"):
            value = getattr(args, name)
            if isinstance(value, bool) or not math.isfinite(value):
                raise HookrunError(f"{key}.{name}: {value!r}; valid: a finite number")
        if not args.epsilon > 0:
            raise HookrunError(f"{key}.epsilon: {args.epsilon}; valid: a number > 0")
        if not args.stabilizer > 0:
            raise HookrunError(f"{key}.stabilizer: {args.stabilizer}; valid: a number > 0")
        if args.gamma < 0:
            raise HookrunError(f"{key}.gamma: {args.gamma}; valid: a number >= 0")
        if args.composite == "epsilon_gamma_box":
            if args.low is None or args.high is None:
                raise HookrunError(
                    f"{key}.low: {args.low!r}, {key}.high: {args.high!r}: epsilon_gamma_box "
                    "needs the first layer's box and the dataset gives no mean/std; valid: "
                    "numbers, or one number per channel"
                )
            check_rule(RuleArgs("zbox", low=args.low, high=args.high), key)
        user_entries(args.rules or {}, f"{key}.rules", args.low, args.high)
        if args.composite == ATTNLRP and args.rules:
            raise HookrunError(
                f"{key}.rules: {sorted(args.rules)!r} with composite attnlrp, whose rules are "
                "fixed; valid: {} with attnlrp, or a vision composite"
            )

    def requires(self, args: LRPArgs) -> list[str]:
        return []

    def prepare(self, args: LRPArgs, model: nn.Module, sample: torch.Tensor) -> LRPState:
        tokens = getattr(getattr(model, "config", None), "model_type", None) is not None
        if args.composite == ATTNLRP:
            sites = attnlrp_sites(model, f"{KEY}.composite")
            lines = [
                f"attnlrp ({sites.family}): identity on {len(sites.activations)} activations, "
                f"constant denominators on {len(sites.norms)} norms, query/key gradients / 4 "
                f"and value / 2 on {len(sites.qkv)} projections"
                + (f", gated products / 2 on {len(sites.products)}" * bool(sites.products))
            ]
            return LRPState({}, tuple(lines), sites)
        if tokens and sample.dim() == 2:  # a language model's embeddings (T, D)
            raise HookrunError(
                f"{KEY}.composite: {args.composite!r} is a vision composite and the model is a "
                f"language model ({type(model).__name__}); valid here: {ATTNLRP}"
            )
        with canonized(model, args.canonize) as done:
            entries = _entries(args, model)
            chosen = assign(model, entries, KEY)
            order = {name: i for i, (name, _) in enumerate(model.named_modules())}
            lines = [*_fewer(done), *(e.line() for e in entries)]
            by_entry: dict[str, list[str]] = {}
            for name in sorted(chosen, key=order.__getitem__):
                by_entry.setdefault(chosen[name][0], []).append(name)
            for entry, names in by_entry.items():
                shown = ", ".join(names[:6]) + (f", … ({len(names)} modules)" * (len(names) > 6))
                lines.append(f"{entry} on {shown}")
        rules = {name: rule for name, (_, rule) in chosen.items()}
        return LRPState(rules, tuple(lines))

    def describe(self, args: LRPArgs, state: LRPState) -> list[str]:
        """The rules and where they stand, for the dry run."""
        return [f"lrp: {line}" for line in state.lines]

    def stored_shapes(
        self, args: LRPArgs, state: LRPState, key: str, sample: tuple[int, ...]
    ) -> dict[str, tuple[int, ...]]:
        return {key: sample, layout.gap_key(self.name, "input"): ()}

    def gives_output(self, args: LRPArgs, state: LRPState) -> bool:
        """AttnLRP's forward is the model's own, value for value (its hooks change gradients
        only); the vision rules run on the canonized model, whose output is rounded apart."""
        return state.sites is not None

    def passes(self, args: LRPArgs, state: LRPState, batch: BatchContext) -> dict[str, Any]:
        if state.sites is not None:
            relevance, output = attnlrp_of(batch, state.sites)
        else:
            relevance, output = relevance_of(batch, state.rules, args.canonize)
        gap = relevance.flatten(1).sum(1) - output.flatten(1).sum(1)
        return {
            layout.derived_key(self.name, "input"): relevance.float().cpu(),
            layout.gap_key(self.name, "input"): gap.float().cpu(),
        }


def relevance_of(
    batch: BatchContext, rules: dict[str, Rule], canonize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input's relevance, the output's) for the batch: one forward pass and one backward
    pass under the rules' hooks, on the model canonized for them."""
    x = batch.explained().detach().requires_grad_(True)
    every = torch.arange(len(x), device=x.device)
    model = batch.model
    with canonized(model, canonize), hooked(rule_hooks(model, rules)), torch.enable_grad():
        out = batch.run(x, every)
        score = batch.score(out, batch.targets)
        (slope,) = torch.autograd.grad(score.sum(), out, retain_graph=True)
        start = out.detach() * slope  # one-hot × logit for a target logit
        (relevance,) = torch.autograd.grad(out, x, start)
    return relevance.detach(), start


def attnlrp_of(batch: BatchContext, sites: AttnSites) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input embeddings' relevance, the output's) for the batch by AttnLRP: one forward
    pass and one backward pass under its hooks, the relevance Gradient × Input."""
    x = batch.explained().detach().requires_grad_(True)
    every = torch.arange(len(x), device=x.device)
    with hooked(attnlrp_hooks(batch.model, sites)), torch.enable_grad():
        out = batch.run(x, every)
        # No forward of the run's own (gives_output): the targets come from this one.
        targets = batch.targets if batch.choose is None else batch.choose(out)
        score = batch.score(out, targets)
        (slope,) = torch.autograd.grad(score.sum(), out, retain_graph=True)
        (grad,) = torch.autograd.grad(out, x, slope)
    return (x * grad).detach(), (out.detach() * slope)
