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
    heads, layers = graph.head_count, len(graph.heads)

    def keep_embed(module, args):
        now["embed"] = args[0]

    def keep_heads(layer):
        def hook(module, args):
            now[f"z{layer}"] = args[0]

        return hook

    def keep_mlp(layer):
        def hook(module, args, output):
            now[f"m{layer}"] = output[0] if isinstance(output, tuple) else output

        return hook

    def ablate(receiver: int):
        # Graph.senders' order: embed, then per layer its heads and its MLP.
        by_layer = cut[1:, receiver].view(layers, heads + 1).tolist()
        embed_cut = bool(cut[0, receiver])

        def hook(module, args):
            if not embed_cut and not any(any(row) for row in by_layer):
                return None
            x = args[0]
            taken = torch.zeros_like(x)
            if embed_cut:
                taken += now["embed"] - corrupted["embed"].to(x.dtype)
            for layer, row in enumerate(by_layer):
                if any(row[:heads]):  # the cut heads' writes: their slices' difference projected
                    diff = now[f"z{layer}"] - corrupted[f"z{layer}"].to(x.dtype)
                    n, t, width = diff.shape
                    which = torch.tensor(row[:heads], device=x.device, dtype=x.dtype)
                    diff = (diff.view(n, t, heads, width // heads) * which[:, None]).view(
                        n, t, width
                    )
                    taken += head_writes(named[graph.heads[layer]], diff, heads).sum(2)
                if row[heads]:
                    taken += now[f"m{layer}"] - corrupted[f"m{layer}"].to(x.dtype)
            return (x - taken, *args[1:])

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
