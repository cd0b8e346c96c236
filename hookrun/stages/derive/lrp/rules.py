"""The LRP rules: how one module hands the relevance at its output back to its input.

Each rule is the backward of one module: `relevance(module, x, output, grad)` takes the
relevance at the module's output (`grad`, the gradient that flows back: Zennit's scheme) and
returns the relevance at its input. The formulas are Zennit 0.5.1's (`zennit/rules.py`),
written out so a reader can check them against the papers: the denominators are stabilised
as Zennit's `stabilize` does (each entry moved away from 0 by `stabilizer` with its sign, 0
counting as positive), and the modified layers are the module's own forward with changed
weights (`weight`, `bias`), run on changed inputs.

A rule's arguments are checked before any work (`check_rule`): the key, the bad value and
the valid range in one line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hookrun.errors import HookrunError, did_you_mean

__all__ = ["RuleArgs", "Rule", "RULES", "check_rule", "make_rule", "stabilize"]


@dataclass
class RuleArgs:
    """One rule's name and arguments, as a `derive.lrp.rules.<name>` entry or a composite gives
    them."""

    rule: str
    """epsilon | zplus | gamma | alpha_beta | flat | wsquare | zbox | pass | norm"""
    epsilon: float = 1e-6
    """epsilon: the ε added to each denominator with its sign (> 0)."""
    stabilizer: float = 1e-6
    """The other rules: the small number that keeps each denominator off zero (> 0)."""
    gamma: float = 0.25
    """gamma: how much the positive (or negative) contributions are favoured (>= 0)."""
    alpha: float = 2.0
    """alpha_beta: the positive contributions' weight (alpha - beta = 1)."""
    beta: float = 1.0
    """alpha_beta: the negative contributions' weight (>= 0)."""
    low: Any = None
    """zbox: the input's lowest value (a number, or one per channel); null: derive.lrp.low."""
    high: Any = None
    """zbox: the input's highest value; null: derive.lrp.high."""


def stabilize(value: torch.Tensor, epsilon: float) -> torch.Tensor:
    """`value` moved away from zero by `epsilon` with its sign (0 counts as positive)."""
    sign = (value == 0.0).to(value) + value.sign()
    return value + sign * epsilon


Params = tuple[torch.Tensor | None, torch.Tensor | None]


def _call(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The module's forward with `weight` and `bias` in place of its own, hooks left out."""
    if type(module) is nn.Linear:
        return F.linear(x, weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return module._conv_forward(x, weight, bias)
    # Any other layer with a weight (a transposed convolution): its forward on swapped
    # parameters, put back at once.
    kept = module.weight, module.bias
    try:
        module.weight = nn.Parameter(weight, requires_grad=False)
        if kept[1] is not None or bias is not None:
            module.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return module.forward(x)
    finally:
        module.weight, module.bias = kept


def _transposable(module: nn.Module) -> bool:
    """Whether the input gradient of the module's linear map has a direct op here."""
    if type(module) is nn.Linear:
        return True
    conv = isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
    return conv and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def _transposed(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """Wᵀ grad for the module's layer with `weight` at an input shaped like x: the op its
    autograd backward runs, without building a graph for it."""
    if type(module) is nn.Linear:
        return grad.matmul(weight)
    return torch.ops.aten.convolution_backward(
        grad, x.new_empty(1).expand(x.shape), weight, None, module.stride, module.padding,
        module.dilation, False, [0], module.groups, (True, False, False),
    )[0]  # fmt: skip


def _vjp(
    module: nn.Module,
    points: Sequence[torch.Tensor],
    params: Sequence[Params],
    grads: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """For each branch i: the vector-Jacobian product of grads[i] with respect to the input
    of the modified layer (weights params[i]) at points[i] (the bias drops out)."""
    if _transposable(module):
        return [
            _transposed(module, x, w, g) for x, (w, _), g in zip(points, params, grads, strict=True)
        ]
    inputs = [p.detach().requires_grad_(True) for p in points]
    with torch.enable_grad():
        outputs = [_call(module, x, w, b) for x, (w, b) in zip(inputs, params, strict=True)]
        return list(torch.autograd.grad(outputs, inputs, grad_outputs=list(grads)))


def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight.detach(), None if module.bias is None else module.bias.detach()


def _pos(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clamp(min=0)


def _neg(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clamp(max=0)


class Rule:
    """One rule with its arguments: `relevance` is the module's backward."""

    name: ClassVar[str]
    # Whether the rule reads the module's weight (and bias): a layer with parameters.
    weighted: ClassVar[bool] = True

    def __init__(self, args: RuleArgs) -> None:
        self.args = args

    def relevance(
        self, module: nn.Module, x: torch.Tensor, output: torch.Tensor, grad: torch.Tensor
    ) -> torch.Tensor:
        """The relevance at the module's input.

        Args:
            module: The module the rule stands on.
            x: Its input at this call.
            output: Its output at this call.
            grad: The relevance at its output.

        Returns:
            The relevance at its input (x's shape).
        """
        raise NotImplementedError

    def describe(self) -> str:
        """`epsilon(epsilon=1e-06)`: the rule and the arguments it reads."""
        names = _ARGUMENTS[self.name]
        shown = ", ".join(f"{k}={_short(getattr(self.args, k))}" for k in names)
        return f"{self.name}({shown})"


def _short(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Epsilon(Rule):
    """LRP-ε: R_in = x ⊙ Wᵀ (R / (z ± ε)), z the layer's output."""

    name = "epsilon"

    def relevance(self, module, x, output, grad):
        w, _ = _weights(module)
        s = grad / stabilize(output, self.args.epsilon)
        (g,) = _vjp(module, [x], [(w, None)], [s])
        return x * g


def _split(x: torch.Tensor) -> list[torch.Tensor]:
    """[x⁺, x⁻], or [x⁺] alone where x has no negative entry (a rectified input: x⁻ = 0
    adds exactly nothing to any branch, so its forward and backward are skipped)."""
    if bool((x < 0).any()):
        return [x.clamp(min=0), x.clamp(max=0)]
    return [x.clamp(min=0)]


def _through(
    module: nn.Module, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    grad: torch.Tensor, stabilizer: float,
) -> torch.Tensor:  # fmt: skip
    """Σ_i x_i ⊙ W_iᵀ (R / (Σ_i z_i ± stabilizer)), z_i the layer with W_i (and b_i) at x_i."""
    z = sum(_call(module, x, weight, bias) for x, weight, bias in parts)
    s = grad / stabilize(z, stabilizer)
    g = _vjp(module, [x for x, _, _ in parts], [(w, None) for _, w, _ in parts], [s] * len(parts))
    return sum(x * gi for (x, _, _), gi in zip(parts, g, strict=True))


class ZPlus(Rule):
    """z⁺ (α=1, β=0 on positive and negative inputs): x⁺ through W⁺ (bias⁺), x⁻ through W⁻."""

    name = "zplus"

    def relevance(self, module, x, output, grad):
        w, b = _weights(module)
        wp, wn = _pos(w), _neg(w)
        parts = list(zip(_split(x), (wp, wn), (_pos(b), None), strict=False))
        return _through(module, parts, grad, self.args.stabilizer)


class AlphaBeta(Rule):
    """α·(positive contributions) − β·(negative contributions), each normalised on its own."""

    name = "alpha_beta"

    def relevance(self, module, x, output, grad):
        w, b = _weights(module)
        a = self.args
        wp, wn = _pos(w), _neg(w)
        split = _split(x)
        up = list(zip(split, (wp, wn), (_pos(b), None), strict=False))
        down = list(zip(split, (wn, wp), (_neg(b), None), strict=False))
        positive = _through(module, up, grad, a.stabilizer)
        return a.alpha * positive - a.beta * _through(module, down, grad, a.stabilizer)


class Gamma(Rule):
    """Generalised γ: the contributions of the output's sign favoured by γ times themselves."""

    name = "gamma"

    def relevance(self, module, x, output, grad):
        w, b = _weights(module)
        a = self.args
        wp, wn = w + a.gamma * w.clamp(min=0), w + a.gamma * w.clamp(max=0)
        bp = None if b is None else b + a.gamma * b.clamp(min=0)
        bn = None if b is None else b + a.gamma * b.clamp(max=0)
        z = output  # the layer as it is: which sign each output has
        split = _split(x)
        up = list(zip(split, (wp, wn), (bp, None), strict=False))
        down = list(zip(split, (wn, wp), (bn, None), strict=False))
        return _through(module, up, (z > 0.0) * grad, a.stabilizer) + _through(
            module, down, (z < 0.0) * grad, a.stabilizer
        )


class ZBox(Rule):
    """z^B: the input bounded in [low, high] (per channel), x through W minus the box's
    corners, low through W⁺ and high through W⁻."""

    name = "zbox"

    def relevance(self, module, x, output, grad):
        w, b = _weights(module)
        low, high = (_bound(v, x) for v in (self.args.low, self.args.high))
        z = _call(module, x, w, b) - _call(module, low, _pos(w), _pos(b))
        z = z - _call(module, high, _neg(w), _neg(b))
        s = grad / stabilize(z, self.args.stabilizer)
        g = _vjp(module, [x, low, high], [(w, None), (_pos(w), None), (_neg(w), None)], [s] * 3)
        return x * g[0] - low * g[1] - high * g[2]


def _bound(value: Any, x: torch.Tensor) -> torch.Tensor:
    """A box bound (a number, or one per channel, axis 1) expanded to x's shape."""
    t = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    if t.dim() == 1 and x.dim() > 1:
        t = t.view(1, -1, *(1,) * (x.dim() - 2))
    return t.expand_as(x)


class Flat(Rule):
    """Flat: relevance spread evenly over the receptive field (weights 1, input 1, no bias)."""

    name = "flat"

    def relevance(self, module, x, output, grad):
        ones = torch.ones_like(module.weight.detach())
        unit = torch.ones_like(x)
        bias = None if module.bias is None else torch.zeros_like(module.bias.detach())
        z = _call(module, unit, ones, bias)
        s = grad / stabilize(z, self.args.stabilizer)
        (g,) = _vjp(module, [unit], [(ones, None)], [s])
        return g


class WSquare(Rule):
    """w²: relevance spread by the squared weights (input 1; the bias squared too, as Zennit)."""

    name = "wsquare"

    def relevance(self, module, x, output, grad):
        w, b = _weights(module)
        unit = torch.ones_like(x)
        z = _call(module, unit, w * w, None if b is None else b * b)
        s = grad / stabilize(z, self.args.stabilizer)
        (g,) = _vjp(module, [unit], [(w * w, None)], [s])
        return g


class Pass(Rule):
    """The relevance passed through unchanged (elementwise layers: activations)."""

    name = "pass"
    weighted = False

    def relevance(self, module, x, output, grad):
        return grad


class Norm(Rule):
    """R_in = x ⊙ Jᵀ (R / (z ± stabilizer)) through the module as it is (sums, average pools)."""

    name = "norm"
    weighted = False

    def relevance(self, module, x, output, grad):
        s = grad / stabilize(output, self.args.stabilizer)
        point = x.detach().requires_grad_(True)
        with torch.enable_grad():
            (g,) = torch.autograd.grad(module.forward(point), point, s)
        return x * g


RULES: dict[str, type[Rule]] = {
    r.name: r for r in (Epsilon, ZPlus, Gamma, AlphaBeta, Flat, WSquare, ZBox, Pass, Norm)
}
# The arguments each rule reads (what the plan's lines show; the others are ignored).
_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "epsilon": ("epsilon",),
    "zplus": ("stabilizer",),
    "gamma": ("gamma", "stabilizer"),
    "alpha_beta": ("alpha", "beta", "stabilizer"),
    "flat": ("stabilizer",),
    "wsquare": ("stabilizer",),
    "zbox": ("low", "high", "stabilizer"),
    "pass": (),
    "norm": ("stabilizer",),
}


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HookrunError(f"{key}: {value!r}; valid: a finite number")
    return float(value)


def _bounds(key: str, value: Any) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise HookrunError(f"{key}: []; valid: a number or one number per channel")
    return [_number(key, v) for v in values]


def check_rule(args: RuleArgs, key: str) -> None:
    """Refuse an unknown rule or arguments out of its range, naming `key.<argument>`."""
    if args.rule not in RULES:
        raise HookrunError(
            f"{key}.rule: {args.rule!r} is not an LRP rule; valid: {', '.join(RULES)}"
            f"{did_you_mean(args.rule, RULES)}"
        )
    used = _ARGUMENTS[args.rule]
    for name in ("epsilon", "stabilizer", "gamma", "alpha", "beta"):
        if name in used:
            _number(f"{key}.{name}", getattr(args, name))
    if args.rule == "epsilon" and not args.epsilon > 0:
        raise HookrunError(f"{key}.epsilon: {args.epsilon}; valid: a number > 0")
    if "stabilizer" in used and not args.stabilizer > 0:
        raise HookrunError(f"{key}.stabilizer: {args.stabilizer}; valid: a number > 0")
    if args.rule == "gamma" and args.gamma < 0:
        raise HookrunError(f"{key}.gamma: {args.gamma}; valid: a number >= 0")
    if args.rule == "alpha_beta" and (
        args.alpha < 0 or args.beta < 0 or args.alpha - args.beta != 1
    ):
        raise HookrunError(
            f"{key}: alpha={args.alpha}, beta={args.beta}; valid: alpha >= 0, beta >= 0 and "
            "alpha - beta = 1 (e.g. alpha=2, beta=1)"
        )
    if args.rule == "zbox":
        if args.low is None or args.high is None:
            raise HookrunError(
                f"{key}: zbox needs low and high (the input's box); got low={args.low!r}, "
                f"high={args.high!r}; valid: numbers, or one number per channel"
            )
        low, high = _bounds(f"{key}.low", args.low), _bounds(f"{key}.high", args.high)
        if len(low) != len(high) and 1 not in (len(low), len(high)):
            raise HookrunError(
                f"{key}: low has {len(low)} values, high {len(high)}; valid: as many of each "
                "(one per channel), or a single number"
            )
        wide = max(len(low), len(high))
        low, high = (v * wide if len(v) == 1 else v for v in (low, high))
        for i, (lo, hi) in enumerate(zip(low, high, strict=True)):
            if not lo < hi:
                where = f"[{i}]" if wide > 1 else ""
                raise HookrunError(
                    f"{key}.low{where}: {lo} is not below {key}.high{where}={hi}; valid: low < "
                    "high (the box of the first layer's input)"
                )


def make_rule(args: RuleArgs) -> Rule:
    """The rule `args.rule` with its arguments (checked already)."""
    return RULES[args.rule](args)
