"""One prompt's attribution graph: its nodes and the direct effects between them.

The semantics are circuit-tracer 0.5's (tests/graph/graph_models.py writes them out, and
tests/graph compares the two): node order [selected features (layer, position, feature in
that order), errors (layer, position), tokens (position), logits (descending probability)];
`A[target, source]` the direct effect — the target's input direction carried back through
the frozen model (replacement.py) to the source's write point, dotted with what the source
wrote there (a feature: activation × decoder row; an error: the error vector; a token: its
embedding). A logit's direction is its unembedding row minus the vocabulary's mean, at
ln_f's output; a feature's is its encoder row at the transcoder's input. Position 0 is the
beginning of the text: its features and errors are zero, as circuit-tracer zeroes them.

The rows are computed `batch` targets a pass, and kept sparse (CSR: each row's non-zero
columns and values), so memory is one batch of dense rows plus the non-zero entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hookrun.stages.graph.replacement import Block, Replacement

__all__ = ["Graph", "Nodes", "active_features", "logit_targets", "attribute"]

# Entries of a (batch, positions, latents) product per block of a layer's feature edges.
_CHUNK_ENTRIES = 1 << 24


@dataclass
class Nodes:
    """What the graph's nodes are: the features active on the prompt and the sizes."""

    features: Tensor  # (n, 3) long: layer, position, feature (lexicographic)
    activations: Tensor  # (n,)
    errors: Tensor  # (L, T, d): MLP output minus the transcoder's reconstruction
    layers: int
    positions: int


@dataclass
class Graph:
    """The attribution graph of one prompt (see the module docstring for the order)."""

    tokens: Tensor  # (T,)
    features: Tensor  # (n, 3) every active feature
    activations: Tensor  # (n,)
    selected: Tensor  # (F,) indices into features that are nodes
    logit_tokens: Tensor  # (K,)
    logit_probabilities: Tensor  # (K,)
    crow: Tensor  # (N + 1,) CSR row pointers of the adjacency, N = F + L*T + T + K
    col: Tensor  # (nnz,) int32 (4 bytes an entry: the entries are what a graph's memory is)
    val: Tensor  # (nnz,) float32
    layers: int

    @property
    def n_nodes(self) -> int:
        return int(self.crow.numel() - 1)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    def dense(self) -> Tensor:
        """The adjacency as a dense (N, N) tensor (for small graphs and tests)."""
        dense = torch.zeros(self.n_nodes, self.n_nodes)
        dense[self.rows(), self.col] = self.val
        return dense

    def rows(self) -> Tensor:
        """Each stored entry's row (target), aligned with col and val (int32, as col)."""
        counts = self.crow[1:] - self.crow[:-1]
        return torch.repeat_interleave(torch.arange(self.n_nodes, dtype=torch.int32), counts)


def _encode(block: Block) -> Tensor:
    """The transcoder's activations at every position (T, S), position 0 zeroed."""
    tc = block.transcoder
    t = {k: v.to(block.x_hat.dtype) for k, v in tc.tensors.items()}
    pre = block.tc_input() @ t["W_enc"] + t["b_enc"]
    acts = pre * (pre > t["threshold"]) if "threshold" in t else pre.relu()
    acts[0] = 0
    return acts


def active_features(model: Replacement) -> Nodes:
    """The features active on the prompt and every error vector."""
    found, values, errors = [], [], []
    for layer, block in enumerate(model.blocks):
        acts = _encode(block)
        t = block.transcoder.tensors
        recon = acts @ t["W_dec"].to(acts.dtype) + t["b_dec"].to(acts.dtype)
        if "W_skip" in t:
            recon = recon + block.tc_input() @ t["W_skip"].to(acts.dtype)
        error = block.mlp_out - recon
        error[0] = 0
        errors.append(error)
        pos, feat = torch.nonzero(acts, as_tuple=True)
        found.append(torch.stack([torch.full_like(pos, layer), pos, feat], 1))
        values.append(acts[pos, feat])
    t_len = model.blocks[0].x_hat.shape[0]
    return Nodes(torch.cat(found), torch.cat(values), torch.stack(errors), len(model.blocks), t_len)


def logit_targets(logits: Tensor, max_logits: int, probability: float) -> tuple[Tensor, Tensor]:
    """The most probable next tokens until their probabilities sum to `probability`, at
    most `max_logits` of them: (ids, probabilities), most probable first."""
    probs = torch.softmax(logits, dim=-1)
    top_p, top_idx = torch.topk(probs, min(max_logits, probs.numel()))
    cut = int(torch.searchsorted(torch.cumsum(top_p, 0), probability)) + 1
    return top_idx[:cut], top_p[:cut]


class _Rows:
    """Computes adjacency rows for batches of targets through the replacement model."""

    def __init__(self, model: Replacement, nodes: Nodes, selected: Tensor):
        self.model, self.nodes = model, nodes
        self.selected = selected
        n_sel = selected.numel()
        self.n_sources = n_sel + nodes.layers * nodes.positions + nodes.positions
        # which column each active feature is (-1: not a node)
        column = torch.full((nodes.features.shape[0],), -1, dtype=torch.long)
        column[selected] = torch.arange(n_sel)
        # per layer: the features' columns, positions (ascending), latents, activations
        self.by_layer = []
        for layer in range(nodes.layers):
            mine = torch.nonzero((nodes.features[:, 0] == layer) & (column >= 0)).flatten()
            f = nodes.features[mine]
            pos, latent = f[:, 1].contiguous(), f[:, 2].contiguous()  # searched, indexed
            self.by_layer.append((column[mine], pos, latent, nodes.activations[mine]))
        self.w_dec = [
            b.transcoder.tensors["W_dec"].to(nodes.activations.dtype) for b in model.blocks
        ]

    def compute(self, logit_vectors: Tensor | None, features: Tensor | None) -> Tensor:
        """Dense rows (B, sources) for logit targets (K, d directions at ln_f's output) or
        feature targets (indices into nodes.features)."""
        model, nodes = self.model, self.nodes
        t_len = nodes.positions
        d = model.embeds.shape[-1]
        b = logit_vectors.shape[0] if logit_vectors is not None else features.numel()
        dtype = model.embeds.dtype
        rows = torch.zeros(b, self.n_sources, dtype=dtype)
        g = torch.zeros(b, t_len, d, dtype=dtype)
        if logit_vectors is not None:
            g[:, -1] = model.logit_grad(logit_vectors.to(dtype))
            at_layer = None
        else:
            f = nodes.features[features]
            at_layer = f[:, 0]
        n_sel = self.selected.numel()

        def inject(layer: int, mid: Tensor) -> None:
            if at_layer is None:
                return
            mine = torch.nonzero(at_layer == layer).flatten()
            if mine.numel() == 0:
                return
            block = model.blocks[layer]
            feats = f[mine]
            w_enc = block.transcoder.tensors["W_enc"].to(dtype)[:, feats[:, 2]].T  # (m, d)
            pos = feats[:, 1]
            # the encoder row at the transcoder's input, to the residual before ln_2
            mid[mine, pos] += block.input_grad(w_enc, pos)

        def read(layer: int, grad: Tensor) -> None:
            columns, pos, latent, acts = self.by_layer[layer]
            w_dec = self.w_dec[layer]
            if columns.numel():
                # every latent's decoder row against the gradient, a block of positions at
                # a time (B x positions x S), then each active feature's entry x activation
                step = max(1, _CHUNK_ENTRIES // max(1, b * w_dec.shape[0]))
                for start in range(0, t_len, step):
                    lo, hi = torch.searchsorted(pos, torch.tensor([start, start + step])).tolist()
                    if lo == hi:
                        continue
                    products = grad[:, start : start + step] @ w_dec.T  # (B, t, S)
                    picked = products[:, pos[lo:hi] - start, latent[lo:hi]]
                    rows[:, columns[lo:hi]] = picked * acts[lo:hi]
            start = n_sel + layer * t_len
            rows[:, start : start + t_len] = (grad * nodes.errors[layer]).sum(-1)

        g = model.sweep(g, inject, read)
        start = n_sel + nodes.layers * t_len
        rows[:, start:] = (g * model.embeds).sum(-1)
        return rows


@dataclass
class _Batch:
    """The non-zero entries of one pass's rows: row i of the pass is node `nodes[i]`, its
    `counts[i]` entries in `col` / `val` (row-major)."""

    nodes: Tensor  # (b,) int64: a feature's index into nodes.features, or n + its source row
    counts: Tensor  # (b,) int64
    col: Tensor  # (m,) int32: columns among _Rows' sources
    val: Tensor  # (m,) float32

    @classmethod
    def of(cls, nodes: Tensor, dense: Tensor) -> _Batch:
        r, c = torch.nonzero(dense, as_tuple=True)
        counts = torch.bincount(r, minlength=dense.shape[0])
        return cls(nodes.clone(), counts, c.to(torch.int32), dense[r, c].float())

    def local_rows(self) -> Tensor:
        """Each entry's row within the pass (int64)."""
        return torch.repeat_interleave(torch.arange(self.counts.numel()), self.counts)


def _partial_influence(batches: list[_Batch], n_total: int, logit_p: Tensor) -> Tensor:
    """circuit-tracer's compute_partial_influences over the rows computed so far: each
    row's |weights| normalised to sum 1, propagated from the logits' probabilities until
    nothing is left (at most 128 steps)."""
    node = torch.cat([torch.repeat_interleave(b.nodes, b.counts) for b in batches])
    col = torch.cat([b.col for b in batches])
    weights = []
    for b in batches:
        local = b.local_rows()
        total = torch.zeros(b.counts.numel()).index_add_(0, local, b.val.abs())
        weights.append(b.val.abs() / total.clamp(min=1e-8)[local])
    weight = torch.cat(weights)
    prod = torch.zeros(n_total)
    prod[-logit_p.numel() :] = logit_p
    influences = torch.zeros(n_total)
    for _ in range(128):
        prod = torch.zeros(n_total).index_add_(0, col, weight * prod[node])
        if not prod.any():
            break
        influences += prod
    return influences


def attribute(
    model: Replacement,
    tokens: Tensor,
    logits: Tensor,
    *,
    max_logits: int,
    probability: float,
    batch: int,
    max_features: int | None,
) -> Graph:
    """The prompt's graph: every logit's row, then the selected features' rows.

    With `max_features` below the active features, the features are chosen as
    circuit-tracer chooses them: after the logit rows, repeatedly the unvisited features of
    most influence on the logits through the rows so far, 4 × `batch` at a time.
    """
    nodes = active_features(model)
    n = nodes.features.shape[0]
    ids, probs = logit_targets(logits, max_logits, probability)
    unembed = model.unembed
    vectors = unembed[ids] - unembed.mean(0, keepdim=True)
    take = n if max_features is None else min(max_features, n)
    rows = _Rows(model, nodes, torch.arange(n))  # columns: every active feature
    k = ids.numel()
    n_total = rows.n_sources + k
    batches: list[_Batch] = []
    for at in range(0, k, batch):
        first = torch.arange(at, min(at + batch, k)) + rows.n_sources
        batches.append(_Batch.of(first, rows.compute(vectors[at : at + batch], None)))
    visited = torch.zeros(n, dtype=torch.bool)
    done = 0
    while done < take:
        if take == n:
            pending = torch.arange(n)
        else:
            influence = _partial_influence(batches, n_total, probs.float())
            rank = torch.argsort(influence[:n], descending=True)
            pending = rank[~visited[rank]][: min(4 * batch, take - done)]
        for at in range(0, pending.numel(), batch):
            part = pending[at : at + batch]
            batches.append(_Batch.of(part, rows.compute(None, part)))
            visited[part] = True
            done += part.numel()
    selected = torch.nonzero(visited).flatten()
    return _assemble(batches, selected, nodes, tokens, ids, probs, rows.n_sources, n)


def _assemble(batches, selected, nodes, tokens, ids, probs, n_sources, n) -> Graph:
    """The rows in node order, their columns narrowed to the selected features: each pass's
    entries moved into place and dropped, so memory is the graph's entries and one pass's."""
    n_sel = selected.numel()
    k = ids.numel()
    column = torch.full((n_sources,), -1, dtype=torch.int32)
    column[selected] = torch.arange(n_sel, dtype=torch.int32)
    column[n:] = torch.arange(n_sel, n_sel + n_sources - n, dtype=torch.int32)
    row_of = torch.full((n,), -1, dtype=torch.long)
    row_of[selected] = torch.arange(n_sel)
    n_nodes = n_sel + (n_sources - n) + k
    if n_nodes >= 2**31:
        raise ValueError(f"{n_nodes} nodes: past the int32 columns of a graph")

    def placed(b: _Batch) -> tuple[Tensor, Tensor, Tensor]:
        """The pass's rows in node order, each entry's column there, and which are kept."""
        target = torch.where(b.nodes < n, row_of[b.nodes.clamp(max=n - 1)], b.nodes - n + n_sel)
        mapped = column[b.col.long()]
        return target, mapped, mapped >= 0

    counts = torch.zeros(n_nodes, dtype=torch.long)
    for b in batches:
        target, _, kept = placed(b)
        counts.index_add_(
            0,
            target,
            torch.zeros(b.counts.numel(), dtype=torch.long).index_add_(
                0, b.local_rows(), kept.long()
            ),
        )
    crow = torch.zeros(n_nodes + 1, dtype=torch.long)
    crow[1:] = torch.cumsum(counts, 0)
    col = torch.empty(int(crow[-1]), dtype=torch.int32)
    val = torch.empty(int(crow[-1]))
    while batches:
        b = batches.pop(0)
        target, mapped, kept = placed(b)
        local = b.local_rows()[kept]
        # an entry's place: its row's start in the graph plus its rank among its row's kept
        kept_counts = torch.zeros(b.counts.numel(), dtype=torch.long).index_add_(
            0, local, torch.ones_like(local)
        )
        first = torch.cumsum(kept_counts, 0) - kept_counts
        where = crow[target][local] + torch.arange(local.numel()) - first[local]
        col[where] = mapped[kept]
        val[where] = b.val[kept]
    return Graph(
        tokens=tokens,
        features=nodes.features,
        activations=nodes.activations.float(),
        selected=selected,
        logit_tokens=ids,
        logit_probabilities=probs.float(),
        crow=crow,
        col=col,
        val=val,
        layers=nodes.layers,
    )
