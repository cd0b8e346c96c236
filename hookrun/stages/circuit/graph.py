"""The nodes of edge attribution in one model: the senders (the embeddings, each head, each
MLP) and the receivers (each head's query, key and value, each MLP, the logits), by module
name from the architecture table; refused in one line where the table cannot say them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hookrun.errors import HookrunError
from hookrun.models.adapter import adapt
from hookrun.models.architectures import ARCHITECTURE_KEYS, ARCHITECTURES, architecture_of
from hookrun.runtime.handles import ModuleHook
from hookrun.stage import Setup
from hookrun.stages.circuit.reads import Read, Shift, attention_reads, shifted_reads

__all__ = ["Graph", "graph_of", "path_receivers"]


@dataclass(frozen=True)
class Graph:
    """The model's nodes, by module name (relative to the Hugging Face model)."""

    heads: list[str]  # per layer: the attention's output projection
    mlps: list[str]  # per layer: the MLP
    attention_norms: list[str]  # per layer: the norm whose input the attention reads
    mlp_norms: list[str]  # per layer: the norm whose input the MLP reads
    final_norm: str  # the norm whose input the logits read
    head_count: int
    projections: list[list[str]]  # per layer: what makes its queries, keys and values
    reads: list[list[Read]]  # per layer: each head's query, key and value (reads.py)

    @property
    def senders(self) -> list[str]:
        out = ["embed"]
        for layer in range(len(self.heads)):
            out += [f"a{layer}.h{h}" for h in range(self.head_count)] + [f"m{layer}"]
        return out

    @property
    def receivers(self) -> list[str]:
        out = []
        for layer, reads in enumerate(self.reads):
            out += [read.name for read in reads] + [f"m{layer}"]
        return [*out, "logits"]

    def attention_receivers(self, layer: int) -> list[int]:
        """The receiver indices of the layer's reads."""
        first = sum(len(reads) + 1 for reads in self.reads[:layer])
        return list(range(first, first + len(self.reads[layer])))

    def mlp_receiver(self, layer: int) -> int:
        return sum(len(reads) + 1 for reads in self.reads[: layer + 1]) - 1

    def upstream(self) -> torch.Tensor:
        """(senders, receivers) bool: whether the sender writes before the receiver reads."""
        layers = len(self.heads)
        sender_at = [-1.0]  # embed
        for layer in range(layers):
            sender_at += [layer] * self.head_count + [layer + 0.5]  # heads, then the MLP
        receiver_at = []
        for layer, reads in enumerate(self.reads):
            # the attention's heads read, then the MLP
            receiver_at += [layer - 0.25] * len(reads) + [layer + 0.25]
        receiver_at.append(float(layers))
        return torch.tensor(sender_at)[:, None] < torch.tensor(receiver_at)[None, :]

    def shifted(self, named: dict[str, nn.Module], shift: Shift) -> list[ModuleHook]:
        """Hooks under which the receivers read the residual stream plus `shift`'s."""
        attention = [
            (self.attention_norms[i], self.projections[i], self.reads[i])
            for i in range(len(self.heads))
        ]
        return shifted_reads(
            named,
            [(*a, self.attention_receivers(i)) for i, a in enumerate(attention)],
            [(n, self.mlp_receiver(i)) for i, n in enumerate(self.mlp_norms)]
            + [(self.final_norm, len(self.receivers) - 1)],
            shift,
        )


def graph_of(setup: Setup) -> Graph:
    """The model's nodes from the architecture table; refused where it cannot say them."""
    model = setup.model
    entry = architecture_of(model)
    hf = adapt(model).language.hf
    model_type = str(getattr(hf.config, "model_type", type(hf).__name__))
    known = [
        t
        for a in ARCHITECTURES
        if a.causal and a.attention_norm and a.qkv and not a.parallel
        for t in a.model_types
    ]
    if entry is None or not entry.causal or entry.attention_norm is None or not entry.qkv:
        raise HookrunError(
            f"circuit: a {model_type} model, whose attention and MLP inputs hookrun does not "
            f"know; valid: a model of {', '.join(known)} (a new family is an entry of "
            f"models/architectures.py: {', '.join(ARCHITECTURE_KEYS)})"
        )
    if entry.parallel and getattr(hf.config, "use_parallel_residual", True):
        raise HookrunError(
            f"circuit: a {model_type} model with a parallel residual (its attention and MLP both "
            "read the block's input), which edge attribution here does not split; valid: "
            "use_parallel_residual=false, or a model of " + ", ".join(known)
        )
    named = dict(hf.named_modules())
    layers = 0
    while entry.heads.format(layers) in named:
        layers += 1
    norms = [entry.attention_norm, entry.mlp_norm]
    names = [n.format(i) for i in range(layers) for n in norms] + [str(entry.final_norm)]
    names += [p.format(i) for i in range(layers) for p in entry.qkv]
    missing = [n for n in names if n not in named]
    heads = int(getattr(hf.config, "num_attention_heads", 0) or 0)
    if not layers or missing or not heads:
        absent = missing[0] if missing else entry.heads.format(0)
        raise HookrunError(
            f"circuit: the {model_type} model has no module {absent}; valid: a {model_type} "
            "model as transformers builds it"
        )
    kv_heads = int(getattr(hf.config, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise HookrunError(
            f"circuit: the {model_type} model has {heads} query heads and {kv_heads} key/value "
            "heads, which do not group evenly; valid: key/value heads dividing the query heads"
        )
    projections = [[p.format(i) for p in entry.qkv] for i in range(layers)]
    graph = Graph(
        heads=[entry.heads.format(i) for i in range(layers)],
        mlps=[entry.mlp.format(i) for i in range(layers)],
        attention_norms=[entry.attention_norm.format(i) for i in range(layers)],
        mlp_norms=[str(entry.mlp_norm).format(i) for i in range(layers)],
        final_norm=str(entry.final_norm),
        head_count=heads,
        projections=projections,
        reads=[
            attention_reads(
                i, [(n, named[n]) for n in projections[i]], entry.qkv_layout, heads, kv_heads
            )
            for i in range(layers)
        ],
    )
    placed = sorted({str(d) for d in (getattr(hf, "hf_device_map", None) or {}).values()})
    offloaded = [n for n in graph.heads if named[n].weight.device.type == "meta"]
    if len(placed) > 1 or offloaded:  # head_writes reads each projection's weight itself
        raise HookrunError(
            f"circuit: model.device_map puts the model on {', '.join(placed)}"
            + (f" ({offloaded[0]}'s weights exist only during its forward)" if offloaded else "")
            + "; valid: one device (model.device_map=null, or a map to one device)"
        )
    return graph


def path_receivers(graph: Graph, names: list[str]) -> list[str]:
    """circuit.paths as receiver names: each a receiver, or a<layer> for every query, key
    and value of the layer's heads; refused naming the valid ones."""
    receivers = graph.receivers
    out: list[str] = []
    for name in names:
        layer = name[1:] if name.startswith("a") else ""
        if name in receivers:
            out.append(name)
        elif layer.isdigit() and layer == str(int(layer)) and int(layer) < len(graph.heads):
            out += [receivers[r] for r in graph.attention_receivers(int(layer))]
        else:
            shown = receivers if len(receivers) <= 24 else [*receivers[:20], "...", receivers[-1]]
            raise HookrunError(
                f"circuit.paths: {name!r} is not a receiver of this model; valid: "
                f"{', '.join(shown)}, or a<layer> for all of a layer's heads' inputs "
                f"(a0 ... a{len(graph.heads) - 1})"
            )
    twice = sorted({r for r in out if out.count(r) > 1})
    if twice:
        raise HookrunError(
            f"circuit.paths: {list(names)} names the receiver {twice[0]} twice; valid: each once"
        )
    return out
