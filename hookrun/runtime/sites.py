"""Where on a module a hook acts."""

from __future__ import annotations

from enum import Enum

__all__ = ["Site"]


class Site(str, Enum):
    """Where on a module a hook acts."""

    input = "input"  # the module's positional inputs, before it runs (forward pre-hook)
    output = "output"  # the module's output (forward hook)
    grad_input = "grad_input"  # gradient w.r.t. the module's input, through this module only
    grad_output = "grad_output"  # gradient w.r.t. the module's output
    # An attention module's probabilities per head (N, heads, query, key): the softmax its
    # forward computes (hookrun/runtime/plan.py binds it to that call; eager attention only).
    pattern = "pattern"

    @property
    def is_grad(self) -> bool:
        return self in (Site.grad_input, Site.grad_output)
