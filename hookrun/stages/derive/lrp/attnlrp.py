"""AttnLRP (Achtibat et al. 2024) as LXT 2.1's efficient variant computes it: Gradient × Input
with changed gradients, in one forward pass and one backward pass, every change a hook.

LXT 2.1 (`lxt/efficient/patches.py`, `models/gpt2.py`, `models/llama.py`) replaces modules'
forwards; here each change is a hook on the module (runtime/handles.py's `hooked`, so every
one is off on any exit path), and the model's own forward computes every value:

- the MLP's element-wise activation (`act`, `act_fn`): the identity rule, input gradient =
  gradient × output / (input + 1e-10) (LXT's `identity_rule_implicit`);
- LayerNorm / RMSNorm: the denominator (the standard deviation, the root mean square) held
  constant in the backward, the mean not (LXT's `layer_norm_forward`, `rms_norm_forward`,
  Gemma 3's `(1 + weight)` norm as LXT's `gemma3_norm`, its query and key norms included);
- attention: the query's and the key's gradients divided by 4, the value's by 2 (LXT's
  `wrap_attention_forward`), taken at the projections' outputs — what lies between (the head
  reshape, rotary embeddings, the key/value heads' repeat) is linear, so the division
  commutes with it;
- a gated MLP (Llama, Qwen2, Gemma 3): the gradient of `act(gate) * up` divided by 2, at the down
  projection's input (LXT's `gated_mlp_forward`).

A module that takes the identity or a norm rule gets its input detached by a pre-hook and
hands its output back through an autograd function whose backward is the rule. Dropout is off
in eval mode, where hookrun runs the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.runtime.handles import ModuleHook

__all__ = ["FAMILIES", "AttnSites", "attnlrp_hooks", "attnlrp_sites"]

# Model families (Hugging Face `config.model_type`) whose structure the rules cover.
FAMILIES = ("gpt2", "llama", "qwen2", "gemma3_text")
_EPS = 1e-10  # LXT's identity_rule_implicit


@dataclass(frozen=True)
class AttnSites:
    """Where each rule stands on one model, by module name."""

    family: str
    norms: tuple[str, ...]  # LayerNorm / RMSNorm: the denominator constant
    activations: tuple[str, ...]  # the identity rule
    qkv: tuple[tuple[str, tuple[float, ...]], ...]  # projection → its output's gradient factors
    products: tuple[str, ...]  # a gated product's consumer: its input's gradient halved


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def attnlrp_sites(model: nn.Module, key: str) -> AttnSites:
    """The rules' modules on `model`; refuses a family the rules do not cover, or a model of
    a covered family whose blocks lack one of the modules the rules stand on."""
    family = _model_type(model)
    if family not in FAMILIES:
        raise HookrunError(
            f"{key}: 'attnlrp' does not cover model family {family!r} "
            f"({type(model).__name__}); valid: a Hugging Face {', '.join(FAMILIES)} model"
        )
    modules = dict(model.named_modules())
    norms, acts, qkv, products = [], [], [], []
    for name, module in modules.items():
        kind = type(module).__name__
        if isinstance(module, nn.LayerNorm) or kind.endswith("RMSNorm"):
            norms.append(name)
    blocks = [n for n, m in modules.items() if n.endswith(".mlp")]
    for mlp in blocks:
        block = mlp.rsplit(".", 1)[0]
        if family == "gpt2":
            acts.append(f"{mlp}.act")
            width = modules[f"{block}.attn"].embed_dim
            qkv.append((f"{block}.attn.c_attn", (0.25,) * (2 * width) + (0.5,) * width))
        else:
            acts.append(f"{mlp}.act_fn")
            qkv += [(f"{block}.self_attn.{p}_proj", (f,)) for p, f in (("q", 0.25), ("k", 0.25))]
            qkv.append((f"{block}.self_attn.v_proj", (0.5,)))
            products.append(f"{mlp}.down_proj")
    named = [*acts, *(n for n, _ in qkv), *products]
    missing = [n for n in named if not isinstance(modules.get(n), nn.Module)]
    if not blocks or missing or not norms:
        raise HookrunError(
            f"{key}: 'attnlrp' found no {missing[0] if missing else 'blocks (*.mlp) or norms'} "
            f"in this {family} model ({type(model).__name__}); valid: a {family} model as "
            "Hugging Face's transformers builds it"
        )
    return AttnSites(family, tuple(norms), tuple(acts), tuple(qkv), tuple(products))


class _Ruled(torch.autograd.Function):
    """Forward: the module's output as it is; backward: `rule(grad)` at the module's input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output: torch.Tensor, rule: Callable) -> torch.Tensor:
        ctx.rule = rule
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return ctx.rule(grad), None, None


class _Scaled(torch.autograd.Function):
    """Forward: the tensor as it is; backward: its gradient times `factor`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad * ctx.factor, None


def _identity(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Callable:
    ratio = out / (x + _EPS)
    return lambda grad: grad * ratio


def _layer_norm(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Callable:
    mean = x.mean(dim=-1, keepdim=True)
    std = (((x - mean) ** 2).mean(dim=-1, keepdim=True) + module.eps).sqrt()
    weight = module.weight

    def rule(grad: torch.Tensor) -> torch.Tensor:
        # y = (x - mean(x)) / std * w + b with std constant: centring is its own transpose.
        c = (grad * weight if weight is not None else grad) / std
        return c - c.mean(dim=-1, keepdim=True)

    return rule


def _rms_norm(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Callable:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    weight = module.weight
    if type(module).__name__.startswith("Gemma"):
        gain = 1.0 + weight.float()

        def gemma(grad: torch.Tensor) -> torch.Tensor:
            # Gemma 3: y = (x.float() * rms⁻¹ * (1 + w)).to(dtype) with rms⁻¹ constant.
            return (grad.float() * gain * scale).to(x.dtype)

        return gemma

    def rule(grad: torch.Tensor) -> torch.Tensor:
        # y = w * (x.float() * rms⁻¹).to(dtype) with rms⁻¹ constant.
        return ((grad * weight).float() * scale).to(x.dtype)

    return rule


class _Site:
    """A module's pre-hook (its input kept, the module run on it detached) and hook (its
    output handed back through `_Ruled` with the rule `make` builds from the call)."""

    def __init__(self, make: Callable) -> None:
        self.make = make
        self.inputs: list[torch.Tensor | None] = []

    def before(self, module: nn.Module, args: tuple) -> tuple | None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not x.requires_grad:
            self.inputs.append(None)
            return None
        self.inputs.append(x)
        return (x.detach(), *args[1:])

    def after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        x = self.inputs.pop()
        if x is None or not isinstance(output, torch.Tensor):
            return None
        with torch.no_grad():
            rule = self.make(module, x.detach(), output.detach())
        return _Ruled.apply(x, output.detach(), rule)


def _scale_output(factors: tuple[float, ...]) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        factor = torch.tensor(factors, dtype=output.dtype, device=output.device)
        return _Scaled.apply(output, factor if len(factors) > 1 else factors[0])

    return hook


def _halve_input(module: nn.Module, args: tuple) -> tuple | None:
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
        return None
    return (_Scaled.apply(args[0], 0.5), *args[1:])


def attnlrp_hooks(model: nn.Module, sites: AttnSites) -> list[ModuleHook]:
    """Every hook of the rules on `model` (its modules named by `sites`)."""
    modules = dict(model.named_modules())
    hooks, seen = [], set()
    for names, make in ((sites.activations, _identity), (sites.norms, None)):
        for name in names:
            module = modules[name]
            if id(module) in seen:  # one module shared by blocks: one rule per call
                continue
            seen.add(id(module))
            rule = make or (_layer_norm if isinstance(module, nn.LayerNorm) else _rms_norm)
            site = _Site(rule)
            hooks += [ModuleHook(module, site.before, before=True), ModuleHook(module, site.after)]
    hooks += [ModuleHook(modules[name], _scale_output(f)) for name, f in sites.qkv]
    hooks += [ModuleHook(modules[name], _halve_input, before=True) for name in sites.products]
    return hooks
