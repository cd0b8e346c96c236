"""Edge attribution patching (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024).

The residual stream a node reads is the sum of what every node before it wrote: the
embeddings, each attention head (its slice of the output projection's input times that
slice of the projection's weight), each MLP. An edge u → v is u's write as v reads it, and
its score is the first-order change of the logit difference were u's write the clean run's
instead of the corrupted run's, on that edge alone:

    (w_u(clean) − w_u(corrupted)) · ∂ logit_diff / ∂ (v's input)

summed over positions and features, the gradient taken through v alone at the corrupted run
(eap) or averaged over `ig_steps` runs whose input embeddings lie k/ig_steps of the way from
the corrupted prompt to the clean one (eap_ig). A receiver's input is its norm's input
(a block's attention, a block's MLP, the final norm before the logits): a pre-hook hands the
norm a copy of it, so the gradient to that copy is the gradient through that receiver only.
Receivers read every head of a layer's attention together (their queries, keys and values
are not told apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hookrun.runtime.handles import ModuleHook, hooked

__all__ = [
    "Graph",
    "Deltas",
    "Runs",
    "both_runs",
    "edge_scores",
    "path_patched",
    "logit_diff",
    "head_writes",
    "writes",
    "sender_deltas",
    "receiver_norms",
]


def logit_diff(
    logits: torch.Tensor, read: torch.Tensor, right: torch.Tensor, wrong: torch.Tensor
) -> torch.Tensor:
    """(N,) logit(answer) − logit(counterfactual answer) at each row's read position."""
    at = logits[torch.arange(len(read), device=read.device), read].float()
    return at.gather(1, right[:, None])[:, 0] - at.gather(1, wrong[:, None])[:, 0]


@dataclass(frozen=True)
class Graph:
    """The model's nodes, by module name (relative to the Hugging Face model)."""

    heads: list[str]  # per layer: the attention's output projection
    mlps: list[str]  # per layer: the MLP
    attention_norms: list[str]  # per layer: the norm whose input the attention reads
    mlp_norms: list[str]  # per layer: the norm whose input the MLP reads
    final_norm: str  # the norm whose input the logits read
    head_count: int

    @property
    def senders(self) -> list[str]:
        out = ["embed"]
        for layer in range(len(self.heads)):
            out += [f"a{layer}.h{h}" for h in range(self.head_count)] + [f"m{layer}"]
        return out

    @property
    def receivers(self) -> list[str]:
        out = []
        for layer in range(len(self.heads)):
            out += [f"a{layer}", f"m{layer}"]
        return [*out, "logits"]

    def upstream(self) -> torch.Tensor:
        """(senders, receivers) bool: whether the sender writes before the receiver reads."""
        layers = len(self.heads)
        sender_at = [-1.0]  # embed
        for layer in range(layers):
            sender_at += [layer] * self.head_count + [layer + 0.5]  # heads, then the MLP
        receiver_at = []
        for layer in range(layers):
            receiver_at += [layer - 0.25, layer + 0.25]  # the attention reads, then the MLP
        receiver_at.append(float(layers))
        return torch.tensor(sender_at)[:, None] < torch.tensor(receiver_at)[None, :]


def head_writes(projection: nn.Module, inputs: torch.Tensor, heads: int) -> torch.Tensor:
    """(N, T, heads, D): each head's write into the residual stream, from the output
    projection's input (N, T, heads × head width) and its weight (the bias is nobody's), in
    the input's dtype."""
    n, t, width = inputs.shape
    z = inputs.view(n, t, heads, width // heads)
    weight = projection.weight.to(inputs.dtype)
    if isinstance(projection, nn.Linear):  # (D, heads × head width)
        per_head = weight.view(weight.shape[0], heads, width // heads).permute(1, 2, 0)
    else:  # transformers' Conv1D: (heads × head width, D)
        per_head = weight.view(heads, width // heads, weight.shape[1])
    return torch.einsum("nthk,hkd->nthd", z, per_head)


def writes(
    hf: nn.Module, graph: Graph, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[dict, torch.Tensor]:
    """Every sender's write of one run (no gradients), compact: embed (N, T, D), per layer
    the heads as their output projection's input `z<layer>` (N, T, heads × head width: a
    head's write is its slice times the projection's, made when needed — a heads-fold
    smaller than the writes) and the MLP `m<layer>` (N, T, D); and the run's logits."""
    named = dict(hf.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def block_input(module, args):  # the first attention's norm reads the embeddings' write
        seen["embed"] = args[0].detach()

    hooks = [ModuleHook(named[graph.attention_norms[0]], block_input, before=True)]
    for layer, (proj, mlp) in enumerate(zip(graph.heads, graph.mlps, strict=True)):
        hooks.append(
            ModuleHook(
                named[proj],
                lambda m, a, k=f"z{layer}": seen.__setitem__(k, a[0].detach()),
                before=True,
            )
        )
        hooks.append(
            ModuleHook(
                named[mlp],
                lambda m, a, o, k=f"m{layer}": seen.__setitem__(
                    k, (o[0] if isinstance(o, tuple) else o).detach()
                ),
            )
        )
    with hooked(hooks), torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return seen, logits


def _receiver_gradients(
    hf: nn.Module, graph: Graph, ids: torch.Tensor, mask: torch.Tensor, target: tuple, steps: int
) -> list[torch.Tensor]:
    """Each receiver's input gradient (N, T, D), averaged over `steps` interpolated runs,
    in `graph.receivers` order. `target`: (clean ids, read positions, answers,
    counterfactual answers)."""
    clean_ids, read, right, wrong = target
    named = dict(hf.named_modules())
    embed = hf.get_input_embeddings()
    norms = receiver_norms(graph)
    total: list[torch.Tensor] | None = None
    with torch.inference_mode(False), torch.enable_grad():
        corrupt = embed(ids).detach()
        shift = embed(clean_ids).detach() - corrupt
        for k in range(steps):
            start = (corrupt + (k / steps) * shift).requires_grad_(True)
            copies: list[torch.Tensor] = []

            def copy(module, args, copies=copies):
                mine = args[0] + 0  # a node of its own: its gradient flows through this norm only
                copies.append(mine)
                return (mine, *args[1:])

            hooks = [ModuleHook(embed, lambda m, a, o, start=start: start)]
            hooks += [ModuleHook(named[n], copy, before=True) for n in norms]
            with hooked(hooks):
                out = hf(input_ids=ids, attention_mask=mask, use_cache=False)
            diff = logit_diff(out.logits, read, right, wrong)
            grads = torch.autograd.grad(diff.sum(), copies)
            grads = [g.float().detach() for g in grads]
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    assert total is not None
    return [g / steps for g in total]


@dataclass(frozen=True)
class Deltas:
    """Each sender's clean write − its corrupted write (writes' runs), float32, zero at
    padding (it writes nothing anyone reads), in `Graph.senders` order; a layer's heads kept
    as their output projection's input (N, T, heads × head width) and projected when read."""

    embed: torch.Tensor  # (N, T, D)
    heads: list[torch.Tensor]  # per layer (N, T, heads × head width)
    mlps: list[torch.Tensor]  # per layer (N, T, D)
    projections: list[nn.Module]  # per layer: the attention's output projection
    head_count: int

    def layer_heads(self, layer: int) -> torch.Tensor:
        """(N, T, heads, D): the layer's heads' write deltas."""
        return head_writes(self.projections[layer], self.heads[layer], self.head_count)

    def sender(self, s: int, made: dict | None = None) -> torch.Tensor:
        """(N, T, D): sender s's write delta (s indexes Graph.senders); `made` keeps each
        layer's projected heads for the next sender of the layer."""
        if s == 0:
            return self.embed
        layer, at = divmod(s - 1, self.head_count + 1)
        if at == self.head_count:
            return self.mlps[layer]
        made = {} if made is None else made
        if layer not in made:
            made.clear()  # one layer's heads at a time
            made[layer] = self.layer_heads(layer)
        return made[layer][:, :, at]

    def scores(self, grads: torch.Tensor) -> torch.Tensor:
        """(N, senders, R): each sender's delta · each receiver's input gradient `grads`
        (N, R, T, D), summed over positions and features; a layer's heads at a time."""
        out = [torch.einsum("ntd,nrtd->nr", self.embed, grads)[:, None]]
        for layer, mlp in enumerate(self.mlps):
            out.append(torch.einsum("nthd,nrtd->nhr", self.layer_heads(layer), grads))
            out.append(torch.einsum("ntd,nrtd->nr", mlp, grads)[:, None])
        return torch.cat(out, 1)


def sender_deltas(
    graph: Graph, clean: dict, corrupted: dict, hf: nn.Module, mask: torch.Tensor
) -> Deltas:
    """Every sender's clean − corrupted write, from writes' two runs."""
    real = mask[..., None].float()
    named = dict(hf.named_modules())
    layers = range(len(graph.heads))
    return Deltas(
        (clean["embed"] - corrupted["embed"]).float() * real,
        [(clean[f"z{i}"] - corrupted[f"z{i}"]).float() * real for i in layers],
        [(clean[f"m{i}"] - corrupted[f"m{i}"]).float() * real for i in layers],
        [named[name] for name in graph.heads],
        graph.head_count,
    )


def receiver_norms(graph: Graph) -> list[str]:
    """Each receiver's norm, in `graph.receivers` order."""
    layers = range(len(graph.heads))
    return [n for i in layers for n in (graph.attention_norms[i], graph.mlp_norms[i])] + [
        graph.final_norm
    ]


@dataclass(frozen=True)
class Runs:
    """One batch's clean and corrupted runs: each sender's clean − corrupted write and the
    two logit differences (N,)."""

    sent: Deltas
    clean: torch.Tensor
    corrupted: torch.Tensor


def both_runs(hf: nn.Module, graph: Graph, rows: tuple, clean_ids: torch.Tensor) -> Runs:
    """The clean and the corrupted run of a batch, one forward each. `rows`: corrupted ids,
    mask, read positions, answers, counterfactual answers."""
    ids, mask, read, right, wrong = rows
    clean, clean_logits = writes(hf, graph, clean_ids, mask)
    corrupted, corrupted_logits = writes(hf, graph, ids, mask)
    with torch.no_grad():
        return Runs(
            sender_deltas(graph, clean, corrupted, hf, mask),
            logit_diff(clean_logits, read, right, wrong),
            logit_diff(corrupted_logits, read, right, wrong),
        )


def edge_scores(
    hf: nn.Module, graph: Graph, rows: tuple, runs: Runs, target: tuple[torch.Tensor, int]
) -> torch.Tensor:
    """(N, senders, receivers) scores, NaN where the sender is not upstream. `target`: the
    clean ids the interpolated runs go toward, and their number of steps (1: eap)."""
    ids, mask, read, right, wrong = rows
    clean_ids, steps = target
    grads = _receiver_gradients(hf, graph, ids, mask, (clean_ids, read, right, wrong), steps)
    with torch.no_grad():
        scores = runs.sent.scores(torch.stack(grads, 1))  # grads: (N, R, T, D)
        scores[:, ~graph.upstream().to(scores.device)] = float("nan")
    return scores


def path_patched(
    hf: nn.Module, graph: Graph, rows: tuple, sent: Deltas, receivers: list[int]
) -> torch.Tensor:
    """Path patching (Wang et al. 2022): (N, senders) logit differences of the corrupted run
    in which the `receivers` (indices into graph.receivers) read each sender's clean write
    instead of its corrupted one (`sent`: Runs.sent) — the sender's effect along its direct
    edges to them alone, every other path corrupted; NaN where it reaches none of them."""
    ids, mask, read, right, wrong = rows
    named = dict(hf.named_modules())
    norms = receiver_norms(graph)
    upstream = graph.upstream()
    out = torch.full((len(ids), len(graph.senders)), float("nan"), device=ids.device)
    made: dict = {}  # the current layer's projected heads
    for s in range(len(graph.senders)):
        targets = [r for r in receivers if upstream[s, r]]
        if not targets:
            continue

        write = sent.sender(s, made)

        def add(module, args, write=write):
            return (args[0] + write.to(args[0].dtype), *args[1:])

        hooks = [ModuleHook(named[norms[r]], add, before=True) for r in targets]
        with hooked(hooks), torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out[:, s] = logit_diff(logits, read, right, wrong)
    return out
