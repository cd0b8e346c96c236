"""How faithful a circuit is: the run's clean prompts again, every edge outside the circuit
ablated — the receiver reads, along that edge, the sender's corrupted write instead of its
write in this run — and the share of the clean − corrupted logit difference that is left:

    (mean ablated − mean corrupted) / (mean clean − mean corrupted)     over the rows

The circuit of size k is the k edges with the largest mean |score| over the rows. Every edge
kept: nothing is ablated, 1; none kept: each receiver reads the corrupted run's residual
stream, 0 (to float rounding). An ablation is a pre-hook on each receiver's norm that takes
Σ (write in this run − corrupted write) over the senders whose edge to it is cut away from
what the norm reads; the residual stream itself is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.stages.circuit.edges import Graph, head_writes, logit_diff, receiver_norms

__all__ = ["circuit_of", "ablated_diff"]


def circuit_of(mean_scores: torch.Tensor, k: int) -> torch.Tensor:
    """(senders, receivers) bool: the k edges of the largest mean |score| (NaN: no edge)."""
    magnitude = torch.nan_to_num(mean_scores.abs(), nan=-1.0).flatten()
    keep = torch.zeros_like(magnitude, dtype=torch.bool)
    keep[magnitude.argsort(descending=True)[:k]] = True
    return keep.view(mean_scores.shape)


def ablated_diff(
    hf: nn.Module, graph: Graph, rows: tuple, corrupted: dict, kept: torch.Tensor
) -> torch.Tensor:
    """(N,) logit differences of the clean rows with every edge outside `kept` ablated.
    `rows`: clean ids, mask, read positions, answers, counterfactual answers; `corrupted`:
    the corrupted run's writes (edges.writes)."""
    ids, mask, read, right, wrong = rows
    cut = graph.upstream().to(ids.device) & ~kept.to(ids.device)  # (senders, receivers)
    named = dict(hf.named_modules())
    now: dict[str, torch.Tensor] = {}
    heads = graph.head_count
    # Sender s's write: "embed", per layer its heads then its MLP (Graph.senders' order).
    order = ["embed"]
    for layer in range(len(graph.heads)):
        order += [f"a{layer}.{h}" for h in range(heads)] + [f"m{layer}"]

    def write(name: str, which: dict) -> torch.Tensor:
        if name.startswith("a"):
            layer, head = name[1:].split(".")
            return which[f"a{layer}"][:, :, int(head)]
        return which[name]

    def keep_embed(module, args):
        now["embed"] = args[0]

    def keep_heads(layer):
        def hook(module, args):
            now[f"a{layer}"] = head_writes(module, args[0], heads)

        return hook

    def keep_mlp(layer):
        def hook(module, args, output):
            now[f"m{layer}"] = output[0] if isinstance(output, tuple) else output

        return hook

    def ablate(receiver: int):
        senders = [order[s] for s in cut[:, receiver].nonzero()[:, 0].tolist()]

        def hook(module, args):
            if not senders:
                return None
            taken = sum(write(s, now) - write(s, corrupted).to(args[0].dtype) for s in senders)
            return (args[0] - taken, *args[1:])

        return hook

    norms = receiver_norms(graph)
    hooks = [ModuleHook(named[graph.attention_norms[0]], keep_embed, before=True, prepend=True)]
    for layer, (proj, mlp) in enumerate(zip(graph.heads, graph.mlps, strict=True)):
        hooks.append(ModuleHook(named[proj], keep_heads(layer), before=True))
        hooks.append(ModuleHook(named[mlp], keep_mlp(layer)))
    hooks += [ModuleHook(named[n], ablate(r), before=True) for r, n in enumerate(norms)]
    with hooked(hooks), torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, use_cache=False)
    return logit_diff(out.logits, read, right, wrong)
