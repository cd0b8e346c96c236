"""How faithful a circuit is: the run's clean prompts again, every edge outside the circuit
ablated — the receiver reads, along that edge, the sender's corrupted write instead of its
write in this run — and the share of the clean − corrupted logit difference that is left:

    (mean ablated − mean corrupted) / (mean clean − mean corrupted)     over the rows

The circuit of size k: the k edges with the largest mean |score| over the rows, then only
those on a path from the embeddings to the logits through those k (paths.py), as Hanna et
al. (2024) evaluate circuits — EAP-IG's `Graph.apply_topn(k, absolute=True, prune=True)`,
which its `evaluate_area_under_curve` calls. k counts the edges chosen; a circuit holds at
most k, and the file says how many (/circuit/faithfulness_kept). A chosen edge off every
such path is ablated like the rest. Under `ablation=corrupted` that changes no number (to float
rounding), only the count: a node no kept path reaches reads the corrupted residual stream
and writes its corrupted write, and an edge whose receiver reaches the logits through no
kept edge moves nothing they read. Under `ablation=mean` it does change the number: such a
node would write what the mean-ablated inputs make, not its mean write.

Every edge kept: nothing is ablated, 1; none kept: each receiver reads the corrupted run's
residual stream, 0 (to float rounding). An ablation takes Σ (write in this run − corrupted
write) over the senders whose edge to a receiver is cut away from what that receiver reads
(a head's query, key or value: reads.shifted_reads; an MLP's or the final norm's input: a
pre-hook); the residual stream itself is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.stages.circuit.edges import head_writes, logit_diff
from hookrun.stages.circuit.graph import Graph
from hookrun.stages.circuit.paths import on_paths, readers

__all__ = ["circuit_of", "ablated_diff", "SELECTED"]

# /circuit/faithfulness' attribute `selection`: how each circuit was chosen.
SELECTED = (
    "the k edges of largest mean |score| over the rows, then only those on a path from embed "
    "to logits through them (Hanna et al. 2024; EAP-IG Graph.apply_topn(k, absolute=True, "
    "prune=True)); /circuit/faithfulness_kept: each circuit's edges"
)


def circuit_of(mean_scores: torch.Tensor, k: int, graph: Graph) -> torch.Tensor:
    """(senders, receivers) bool: the circuit of size k — the k edges of the graph with the
    largest mean |score| (ties: the first in the file's order; an edge scored NaN in every
    row is chosen last), those on a path from the embeddings to the logits through them."""
    edge = graph.upstream()
    magnitude = torch.nan_to_num(mean_scores.abs().double(), nan=-1.0)
    magnitude[~edge] = -2.0  # a sender that writes after the receiver reads: no edge at all
    chosen = torch.zeros(magnitude.numel(), dtype=torch.bool)
    chosen[magnitude.flatten().argsort(descending=True, stable=True)[:k]] = True
    chosen = chosen.view(mean_scores.shape) & edge
    kept = on_paths(chosen.numpy(), readers(graph.senders, graph.receivers))
    return torch.from_numpy(kept)


def ablated_diff(
    hf: nn.Module, graph: Graph, rows: tuple, corrupted: dict, kept: torch.Tensor
) -> torch.Tensor:
    """(N,) logit differences of the clean rows with every edge outside `kept` ablated.
    `rows`: clean ids, mask, read positions, answers, counterfactual answers; `corrupted`:
    the corrupted run's writes (edges.writes)."""
    ids, mask, read, right, wrong = rows
    cut = graph.upstream() & ~kept.cpu()  # (senders, receivers), read on the host
    on_device = cut.to(ids.device)
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

    def ablated(asked: list[int], x: torch.Tensor):
        """What the `asked` receivers with a cut edge take away from the residual x."""
        chosen = [r for r in asked if bool(cut[:, r].any())]
        if not chosen:
            return None
        into, into_device = cut[:, chosen], on_device[:, chosen].to(x.dtype)  # (senders, k)
        # Graph.senders' order: embed, then per layer its heads and its MLP.
        embed = now["embed"] - corrupted["embed"].to(x.dtype)
        taken = embed[:, :, None] * into_device[0][:, None]
        for layer in range(layers):
            of_layer = slice(1 + layer * (heads + 1), 1 + (layer + 1) * (heads + 1))
            block, weights = into[of_layer], into_device[of_layer]
            if bool(block[:heads].any()):  # the cut heads' writes: their differences projected
                diff = now[f"z{layer}"] - corrupted[f"z{layer}"].to(x.dtype)
                written = head_writes(named[graph.heads[layer]], diff, heads)  # (N, T, H, D)
                taken = taken + torch.einsum("nthd,hk->ntkd", written, weights[:heads])
            if bool(block[heads].any()):
                diff = now[f"m{layer}"] - corrupted[f"m{layer}"].to(x.dtype)
                taken = taken + diff[:, :, None] * weights[heads][:, None]
        return chosen, -taken

    hooks = [ModuleHook(named[graph.attention_norms[0]], keep_embed, before=True, prepend=True)]
    for layer, (proj, mlp) in enumerate(zip(graph.heads, graph.mlps, strict=True)):
        hooks.append(ModuleHook(named[proj], keep_heads(layer), before=True))
        hooks.append(ModuleHook(named[mlp], keep_mlp(layer)))
    hooks += graph.shifted(named, ablated)
    with hooked(hooks), torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, use_cache=False)
    return logit_diff(out.logits, read, right, wrong)
