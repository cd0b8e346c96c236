"""What follows a layer, as a module of its own: the model's output computed from the layer's
output alone, so a method that perturbs that output (Ablation-CAM) runs only the rest of the
network per perturbation, not the whole of it again.

How: torch.fx traces the model with the layer as one leaf call; the nodes that depend on
the layer's output, and the constants they read, become a GraphModule whose one input is
that output (it shares the model's modules and weights: a randomised weight is seen). That
can be decided only where the model traces (no Python control flow on tensor values), the
layer is called once, and nothing computed before the layer joins the model's output after
it — a residual around the layer, a batch size read from the input, an output that returns
earlier features: then there is no rest (`Rest.why` says why) and the caller runs the whole
model. A rest is used only once it gave the model's own output on a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["Rest", "rest_after"]


@dataclass(frozen=True)
class Rest:
    """The model from a layer's output on (`module`), or None and why (`why`)."""

    module: nn.Module | None
    why: str = ""


class _LayerAsLeaf(torch.fx.Tracer):
    """torch.fx's tracer with `layer` one call, however many modules it holds."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        self.layer = layer

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name == self.layer or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        # A module's own code, not its hooks: a caller's hook would run on the tracer's
        # proxies (the rest calls its leaves, so their hooks run; a hook that changes a
        # value elsewhere fails the check on a sample).
        if not self.is_leaf_module(m, self.path_of_module(m)):
            forward = m.forward
        return super().call_module(m, forward, args, kwargs)


class _Crosses(Exception):
    """A node after the layer reads one computed before it (from the model's input)."""


def _graph_after(graph: torch.fx.Graph, layer: str) -> torch.fx.Graph | str:
    """The nodes of `graph` after `layer`'s call, with that call's output as the one input;
    or why they cannot be cut off from what comes before."""
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == layer]
    if len(calls) != 1:
        return f"{layer!r} is called {len(calls)} times in a forward pass"
    start = calls[0]
    from_input: set[torch.fx.Node] = set()  # what the model's input reaches
    from_layer: set[torch.fx.Node] = {start}  # what the layer's output reaches
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "placeholder" or any(i in from_input for i in inputs):
            from_input.add(node)
        if any(i in from_layer for i in inputs):
            from_layer.add(node)
    output = next(n for n in graph.nodes if n.op == "output")
    if output not in from_layer:
        return f"the model's output does not depend on {layer!r}"
    rest = torch.fx.Graph()
    env = {start: rest.placeholder("activation")}

    def copy(node: torch.fx.Node) -> torch.fx.Node:
        if node not in env:
            if node in from_input and node not in from_layer:
                raise _Crosses(node.name)
            for given in node.all_input_nodes:  # a constant's own inputs (get_attr chains)
                copy(given)
            env[node] = rest.node_copy(node, lambda n: env[n])
        return env[node]

    try:
        for node in graph.nodes:
            if node in from_layer:
                copy(node)
    except _Crosses as crossed:
        return (
            f"{crossed.args[0]!r}, computed before {layer!r}, joins the model's output after "
            "it (a residual around the layer, or the input's batch size)"
        )
    return rest


def rest_after(model: nn.Module, layer: str, activation: Any, logits: Any) -> Rest:
    """What follows `layer` in `model` as a module taking the layer's output; checked on
    one sample: `activation`, the layer's output, must give `logits`, the model's."""
    if not isinstance(activation, torch.Tensor):
        return Rest(None, f"{layer!r} gives no single tensor")
    try:
        graph = _LayerAsLeaf(layer).trace(model)
    except Exception as err:  # torch.fx's refusals have no common type
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return Rest(None, f"torch.fx cannot trace the model ({type(err).__name__}: {first})")
    cut = _graph_after(graph, layer)
    if isinstance(cut, str):
        return Rest(None, cut)
    module = torch.fx.GraphModule(model, cut)
    module.graph.eliminate_dead_code()  # a side branch the output never reads
    module.recompile()
    with torch.no_grad():
        try:
            got = module(activation)
        except Exception as err:  # the cut graph is the model's own code: any error
            return Rest(None, f"the rest failed on a sample ({type(err).__name__}: {err})")
    if not (isinstance(got, torch.Tensor) and isinstance(logits, torch.Tensor)):
        return Rest(None, "the model's output is not one tensor")
    scale = float(logits.abs().max()) or 1.0
    if got.shape != logits.shape or not torch.allclose(got, logits, rtol=1e-4, atol=1e-5 * scale):
        return Rest(None, f"the rest from {layer!r} did not give the model's output on a sample")
    return Rest(module)
