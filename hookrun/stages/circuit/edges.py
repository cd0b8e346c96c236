"""Edge attribution patching (EAP, Syed et al. 2023; EAP-IG, Hanna et al. 2024).

The residual stream a node reads is the sum of what every node before it wrote: the
embeddings, each attention head (its slice of the output projection's input times that
slice of the projection's weight), each MLP. An edge u → v is u's write as v reads it, and
its score is the first-order change of the logit difference were u's write the clean run's
instead of the corrupted run's, on that edge alone:

    (w_u(clean) − w_u(corrupted)) · ∂ logit_diff / ∂ (v's input)

summed over positions and features, the gradient taken through v alone at the corrupted run
(eap) or averaged over `ig_steps` runs whose input embeddings lie k/ig_steps of the way from
the corrupted prompt to the clean one, k = 0 … ig_steps − 1 (eap_ig). Beside Hanna et al.
(2024), `SCORE` and `gradient_at` say it in the file: the same sign as theirs (their loss is
−logit_diff), their EAP's gradient at the clean run, their paper code's k = 1 … m.

The receivers are each head's query, key and value (reads.py: the residual stream before
the attention norm, through that head's slice of the projections alone), each MLP and the
logits (the input of the MLP's norm and of the final norm: a pre-hook hands the norm a copy
of it, so the gradient to that copy is the gradient through that receiver only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hookrun.runtime.handles import ModuleHook, hooked
from hookrun.stages.circuit.graph import Graph
from hookrun.stages.circuit.reads import CHUNK, read_gradients

__all__ = [
    "SCORE",
    "gradient_at",
    "Deltas",
    "Runs",
    "both_runs",
    "edge_scores",
    "path_patched",
    "logit_diff",
    "head_writes",
    "writes",
    "sender_deltas",
]


# /circuit/edges' attribute `score`: what a score is, and its sign beside Hanna et al.'s.
SCORE = (
    "(sender's clean write - its corrupted write) . d(logit(answer) - "
    "logit(counterfactual_answer)) / d(receiver's input), summed over positions and features, "
    "per row; > 0: the clean write moves toward the clean answer. Hanna et al. 2024 score "
    "(corrupted - clean) . d(loss), their loss -logit_diff: the same sign"
)


def gradient_at(method: str, steps: int) -> str:
    """/circuit/edges' attribute `gradient_at`: where the gradient is taken (edge_scores)."""
    if method == "eap":
        return (
            "the corrupted run (EAP-IG's k = 0 term alone; Hanna et al.'s EAP takes it at the "
            "clean run)"
        )
    return (
        f"averaged over runs whose input embeddings are corrupted + (k / {steps}) (clean - "
        f"corrupted), k = 0 ... {steps - 1}: the corrupted end in, the clean end out, as "
        "EAP-IG's get_scores_eap_ig; Hanna et al.'s paper code (attribute_mem.py) takes "
        "k = 1 ... m"
    )


def logit_diff(
    logits: torch.Tensor, read: torch.Tensor, right: torch.Tensor, wrong: torch.Tensor
) -> torch.Tensor:
    """(N,) logit(answer) − logit(counterfactual answer) at each row's read position."""
    at = logits[torch.arange(len(read), device=read.device), read].float()
    return at.gather(1, right[:, None])[:, 0] - at.gather(1, wrong[:, None])[:, 0]


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

    def scores(self, grads: torch.Tensor, layers: int, out: torch.Tensor) -> None:
        """Into `out` (N, senders, R), zero to begin with: each sender's delta · each
        receiver's input gradient `grads` (N, R, T, D), summed over positions and features,
        for the senders of the first `layers` layers and the embeddings (the rest stay 0:
        the receivers read before they write); a layer's heads at a time. Written in place:
        small blocks made and kept between the projected heads' big ones would fragment
        glibc's heap."""
        out[:, 0] = torch.einsum("ntd,nrtd->nr", self.embed, grads)
        for layer, mlp in enumerate(self.mlps[:layers]):
            first = 1 + layer * (self.head_count + 1)
            heads = self.layer_heads(layer)
            out[:, first : first + self.head_count] = torch.einsum("nthd,nrtd->nhr", heads, grads)
            del heads
            out[:, first + self.head_count] = torch.einsum("ntd,nrtd->nr", mlp, grads)


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


def _step_scores(
    hf: nn.Module, graph: Graph, rows: tuple, sent: Deltas, start: torch.Tensor
) -> torch.Tensor:
    """(N, senders, receivers): each sender's delta · each receiver's input gradient, summed
    over positions and features, in the run whose input embeddings are `start`. `rows`:
    corrupted ids, mask, read positions, answers, counterfactual answers."""
    ids, mask, read, right, wrong = rows
    named = dict(hf.named_modules())
    layers = len(graph.heads)
    residuals: dict[int, torch.Tensor] = {}  # what each layer's attention norm takes in
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # each layer's q/k/v projections' outputs
    copies: list[torch.Tensor] = []  # what the MLPs' norms and the final norm take in

    def copy(module, args):
        mine = args[0] + 0  # a node of its own: its gradient flows through this norm only
        copies.append(mine)
        return (mine, *args[1:])

    def keep_residual(layer):
        return lambda m, a: residuals.__setitem__(layer, a[0].detach())

    def keep_output(key):
        return lambda m, a, o: outputs.__setitem__(key, o)

    hooks = [ModuleHook(hf.get_input_embeddings(), lambda m, a, o: start)]
    for layer in range(layers):
        norm = named[graph.attention_norms[layer]]
        hooks.append(ModuleHook(norm, keep_residual(layer), before=True))
        for i, name in enumerate(graph.projections[layer]):
            hooks.append(ModuleHook(named[name], keep_output((layer, i))))
    hooks += [ModuleHook(named[n], copy, before=True) for n in [*graph.mlp_norms, graph.final_norm]]
    with hooked(hooks):
        out = hf(input_ids=ids, attention_mask=mask, use_cache=False)
    keys = list(outputs)
    grads = torch.autograd.grad(
        logit_diff(out.logits, read, right, wrong).sum(), [outputs[k] for k in keys] + copies
    )
    at_projections = dict(zip(keys, grads[: len(keys)], strict=True))
    at_norms = [g.float()[:, None] for g in grads[len(keys) :]]  # (N, 1, T, D) each
    scores = torch.zeros(len(ids), len(graph.senders), len(graph.receivers), device=ids.device)
    # The receivers side by side from the MLP of layer l - 1 to the reads of layer l have
    # the same senders (layers before l): scored together, a chunk at a time, so the
    # earlier layers' heads are projected once per chunk (the MLP rides with the first).
    first = 0
    for layer in range(layers + 1):
        mlp = [at_norms[layer - 1]] if layer else []  # (N, 1, T, D)
        if layer == layers:  # the last MLP and the logits
            block = torch.cat([*mlp, at_norms[-1]], 1)
            sent.scores(block, layers, scores[:, :, first:])
            break
        projections = [named[name] for name in graph.projections[layer]]
        reads = graph.reads[layer]
        for lo in range(0, len(reads), CHUNK):
            chunk = reads[lo : lo + CHUNK]
            n, t, width = residuals[layer].shape
            block = scores.new_empty(n, len(mlp) + len(chunk), t, width)
            if mlp:
                block[:, :1] = mlp.pop()
            read_gradients(
                named[graph.attention_norms[layer]],
                residuals[layer],
                projections,
                [at_projections[(layer, i)] for i in range(len(projections))],
                chunk,
                block[:, block.shape[1] - len(chunk) :],  # after the MLP's, if any
            )
            sent.scores(block, layer, scores[:, :, first : first + block.shape[1]])
            first += block.shape[1]
    return scores


def edge_scores(
    hf: nn.Module, graph: Graph, rows: tuple, runs: Runs, target: tuple[torch.Tensor, int]
) -> torch.Tensor:
    """(N, senders, receivers) scores, NaN where the sender is not upstream. `target`: the
    clean ids the interpolated runs go toward, and their number of steps (1: eap)."""
    ids = rows[0]
    clean_ids, steps = target
    embed = hf.get_input_embeddings()
    total: torch.Tensor | None = None
    with torch.inference_mode(False), torch.enable_grad():
        corrupt = embed(ids).detach()
        toward = embed(clean_ids).detach() - corrupt
        for k in range(steps):  # the scores are linear in the gradient: averaged as they come
            start = (corrupt + (k / steps) * toward).requires_grad_(True)
            step = _step_scores(hf, graph, rows, runs.sent, start).detach()
            total = step if total is None else total + step
    assert total is not None
    with torch.no_grad():
        scores = total / steps
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
    upstream = graph.upstream()
    out = torch.full((len(ids), len(graph.senders)), float("nan"), device=ids.device)
    made: dict = {}  # the current layer's projected heads
    for s in range(len(graph.senders)):
        targets = {r for r in receivers if upstream[s, r]}
        if not targets:
            continue
        write = sent.sender(s, made)

        def add(asked: list[int], x: torch.Tensor, write=write, targets=targets):
            chosen = [r for r in asked if r in targets]
            if not chosen:
                return None
            return chosen, write.to(x.dtype)[:, :, None].expand(-1, -1, len(chosen), -1)

        with hooked(graph.shifted(named, add)), torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out[:, s] = logit_diff(logits, read, right, wrong)
    return out
