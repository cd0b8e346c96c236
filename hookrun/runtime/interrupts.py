"""Where a signal stops a backward pass: `signal_checks(model)` puts `signals.check()` before
every node of the graph that each forward of the model builds, for as long as the block runs
(the run's `run_mode` holds it around every pass).

Why the graph and not the modules: a backward pass is one call into autograd's C++ engine,
which runs no Python unless a hook does, so a SIGTERM waited for the whole backward (9.5 s of
one integrated-gradients pass of 55 rows on two busy cores). With a check before each node,
it waits for one node at most. A hook on each module's forward would do the same at module
boundaries, but it would run in every pass, also those without gradients (generation's
decoding steps: 7 % of a small Llama's step); here a pass without gradients costs one call
of one hook on the model's root, and one with gradients a walk over its new nodes.

The forward pass needs nothing: torch's `Module.__call__` is Python, so the signal's handler
acts at the next module call. On CUDA a backward runs on the device's thread while the main
thread waits in C++; the handler acts once the backward returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hookrun.models.adapter import adapt
from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.runtime.leaves import leaves
from hookrun.signals import check

__all__ = ["signal_checks"]

# A node's metadata key: its check is in place (and its inputs' too, walked with it).
_CHECKED = "hookrun.signal_check"


def _check(grad_outputs: tuple) -> None:
    """The check before a node runs; the gradient passes unchanged."""
    check()


def _walk(nodes: list[Any]) -> None:
    """A check on every node reachable from `nodes` that has none yet. A node that has one
    was walked with all below it (by an earlier forward, or the wrapped model's own root),
    so the walk stops there."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node is None or hasattr(node, "variable"):
            continue  # a leaf's gradient accumulator: the caller's tensor keeps it
        meta = node.metadata
        if _CHECKED in meta:
            continue
        meta[_CHECKED] = True
        node.register_prehook(_check)
        todo.extend(child for child, _ in node.next_functions)


def _on_output(module: nn.Module, args: Any, output: Any) -> None:
    if torch.is_grad_enabled():  # without gradients there is no backward to check
        _walk([t.grad_fn for _, t in leaves(output) if t.grad_fn is not None])


@contextmanager
def signal_checks(model: nn.Module) -> Iterator[None]:
    """A signal stops the backward pass of any forward of `model` (or of the model it wraps:
    a stage may call that one directly) between two of its graph's nodes, in the block."""
    roots = [model, *adapt(model).roots()]
    with hooked(ModuleHook(root, _on_output) for root in roots):
        yield
