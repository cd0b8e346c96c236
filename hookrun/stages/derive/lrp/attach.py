"""The LRP rules as hooks: the gradient that flows back is the relevance.

Each module with a rule gets a forward pre-hook and a forward hook (runtime/handles.py's
`hooked`, so every one is off on any exit path). The pre-hook hands the module its input
detached — cloned for an in-place module (`ReLU(inplace=True)`), whose write would otherwise
change the input the rule reads — so the module runs without building a graph of its own.
The forward hook returns the module's output through `_Relevance`, an autograd function of
the module's real input whose backward is the rule: the relevance at the output (the
incoming gradient) becomes the relevance at the input. A module called more than once gets
one node per call, each with that call's input and output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hookrun.runtime.handles import ModuleHook
from hookrun.stages.derive.lrp.rules import Rule

__all__ = ["rule_hooks"]


class _Relevance(torch.autograd.Function):
    """Forward: the module's output as it is; backward: the rule's relevance at the input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output: torch.Tensor, rule: Rule, module: nn.Module):
        ctx.save_for_backward(x, output)
        ctx.rule, ctx.module = rule, module
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, output = ctx.saved_tensors
        with torch.no_grad():
            relevance = ctx.rule.relevance(ctx.module, x, output, grad)
        return relevance, None, None, None


class _Site:
    """The pre-hook and the hook of one module: the call's input kept between them."""

    def __init__(self, module: nn.Module, rule: Rule) -> None:
        self.module, self.rule = module, rule
        self.inplace = bool(getattr(module, "inplace", False))
        self.inputs: list[torch.Tensor] = []

    def before(self, module: nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
            self.inputs.append(None)  # nothing flows back through it: left as it is
            return None
        x = args[0]
        self.inputs.append(x)
        alone = x.detach().clone() if self.inplace else x.detach()
        return (alone, *args[1:])

    def after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        x = self.inputs.pop()
        if x is None or not isinstance(output, torch.Tensor):
            return None
        return _Relevance.apply(x, output.detach(), self.rule, self.module)


def rule_hooks(model: nn.Module, rules: Mapping[str, Rule]) -> list[ModuleHook]:
    """The hooks of every module named in `rules` (module name → its rule)."""
    modules = dict(model.named_modules())
    hooks = []
    for name, rule in rules.items():
        site = _Site(modules[name], rule)
        hooks.append(ModuleHook(site.module, site.before, before=True))
        hooks.append(ModuleHook(site.module, site.after))
    return hooks
