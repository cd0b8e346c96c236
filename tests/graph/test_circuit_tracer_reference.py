"""circuit-tracer 0.5.0, the attribution graphs' reference (circuit_tracer_script.py in
.venv-circuit-tracer), checked against independent computations before anything of hookrun is
compared with it: its TransformerLens model is the HF GPT-2; its active features are the
transcoders encoding the normalised ln_2 input taken from HF by a hook; its logit nodes are the
top tokens of HF's next-token distribution to 0.95 capped at 10; whole adjacency rows (every
logit node's, and a feature's) equal gradients through a frozen forward written here from the
HF weights (attention patterns and LN scales detached, MLP outputs constant, W_skip's path
kept); the scores and prune masks follow from the adjacency by the rules graph_models.py
documents; the graph JSON's links are adjacency entries; the intervention equals a forward
with frozen patterns and the decoder delta added; max_feature_nodes keeps the full graph's rows
and takes the most logit-influential features first. Nothing of hookrun is used, except in
the last test: hookrun's own rows against the same frozen forward.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from graph_models import run_reference, save_gpt2, write_transcoders

PROMPT = [0, 5, 17, 300, 42, 99, 7]
# (model options, transcoder options): a flat next-token distribution (the 10-logit cap
# binds) with ReLU transcoders and HF's identity LN affines; a sharp one (the 0.95 cut binds)
# with JumpReLU, W_skip and random LN affines, where the normalised ln_2 input is not ln_2's
# output.
VARIANTS = {
    "relu": ({"n_layer": 2}, {}),
    "jumprelu_skip": (
        {"n_layer": 3, "ln_affine": True, "ln_f_scale": 40.0, "seed": 5},
        {"threshold": 0.3, "skip": True, "seed": 4},
    ),
}


def _ln(x, ln, scale=None):
    """HF's LayerNorm, by hand: (normalised, output, scale); `scale` given: frozen to it."""
    centred = x - x.mean(-1, keepdim=True)
    if scale is None:
        scale = (centred.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()
    normalised = centred / scale
    return normalised, normalised * ln.weight + ln.bias, scale


def _forward(hf, tokens, *, clean=None, freeze_ln=False, mlp=None, add=None):
    """GPT-2's forward from HF's modules, with what circuit-tracer freezes made explicit.

    clean: a previous run's record; attention patterns are taken from it (frozen), and with
    `freeze_ln` its LN scales too. mlp: None runs HF's MLPs; a callable (layer, x̂) -> the
    MLP output to use instead. add: {layer: tensor [T, d_model]} added to that layer's MLP
    output. Returns a record: logits, embed (the token-embedding leaf), per layer x̂ (ln_2
    normalised input), mlp_out, pattern, scales.
    """
    tr = hf.transformer
    n_head = hf.config.n_head
    rec = {"x_hat": [], "mlp_out": [], "pattern": [], "scales": []}
    embed = tr.wte.weight[tokens].detach().clone().requires_grad_(True)
    rec["embed"] = embed
    x = embed + tr.wpe.weight[: len(tokens)]
    scales = iter(clean["scales"]) if clean is not None and freeze_ln else None
    for layer, block in enumerate(tr.h):
        _, h, s1 = _ln(x, block.ln_1, next(scales) if scales else None)
        q, k, v = block.attn.c_attn(h).split(hf.config.n_embd, dim=-1)
        q, k, v = (t.view(len(tokens), n_head, -1).transpose(0, 1) for t in (q, k, v))
        if clean is not None:
            pattern = clean["pattern"][layer]
        else:
            att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
            pattern = att.masked_fill(~causal, float("-inf")).softmax(-1)
        heads = (pattern @ v).transpose(0, 1).reshape(len(tokens), -1)
        x = x + block.attn.c_proj(heads)
        x_hat, h2, s2 = _ln(x, block.ln_2, next(scales) if scales else None)
        out = block.mlp(h2) if mlp is None else mlp(layer, x_hat)
        if add is not None and layer in add:
            out = out + add[layer]
        x = x + out
        rec["x_hat"].append(x_hat)
        rec["mlp_out"].append(out)
        rec["pattern"].append(pattern.detach())
        rec["scales"] += [s1.detach(), s2.detach()]
    _, final, sf = _ln(x, tr.ln_f, next(scales) if scales else None)
    rec["scales"].append(sf.detach())
    rec["final"] = final
    rec["logits"] = hf.lm_head(final)
    return rec


def _acts(tc, x_hat):
    pre = x_hat @ tc["W_enc"].T + tc["b_enc"]
    if "activation_function.threshold" in tc:
        return pre * (pre > tc["activation_function.threshold"])
    return torch.relu(pre)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, tmp_path_factory):
    """The variant's HF model, transcoders, clean record, and circuit-tracer's OUT.pt."""
    model_opts, tc_opts = VARIANTS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    hf = save_gpt2(tmp / "model", **model_opts)
    tcs = write_transcoders(tmp / "tc", hf, **tc_opts)
    with torch.no_grad():
        clean = _forward(hf, torch.tensor(PROMPT))
        acts = torch.stack([_acts(tcs[i], x)[None] for i, x in enumerate(clean["x_hat"])])[:, 0]
    acts[:, 0] = 0  # circuit-tracer's BOS position
    # The intervention: a feature active at the last position of layer 0, doubled.
    feat = int(acts[0, -1].argmax())
    interventions = [[0, len(PROMPT) - 1, feat, 2.0 * float(acts[0, -1, feat])]]
    spec = {
        "model": str(tmp / "model"),
        "transcoders": str(tmp / "tc"),
        "tokens": PROMPT,
        "max_n_logits": 10,
        "desired_logit_prob": 0.95,
        "batch_size": 256,
        "max_feature_nodes": None,
        "node_threshold": 0.8,
        "edge_threshold": 0.98,
        "interventions": interventions,
    }
    out = run_reference(spec, tmp)
    return {
        "name": request.param,
        "hf": hf,
        "tcs": tcs,
        "clean": clean,
        "acts": acts,
        "out": out,
        "spec": spec,
    }


def test_tl_model_is_the_hf_model_and_the_forward_here_too(case):
    assert case["out"]["tl_vs_hf_max_abs"] < 1e-4
    with torch.no_grad():
        hf_logits = case["hf"](torch.tensor([PROMPT])).logits[0]
    assert torch.allclose(case["clean"]["logits"], hf_logits, atol=1e-5)


def test_active_features_are_the_transcoders_on_the_normalised_ln2_input(case):
    """x̂ taken from HF's ln_2 input by a forward hook and normalised in numpy."""
    hf, tcs, out = case["hf"], case["tcs"], case["out"]
    inputs = {}
    handles = [
        block.ln_2.register_forward_hook(
            lambda m, args, res, i=i: inputs.__setitem__(i, args[0][0].numpy())
        )
        for i, block in enumerate(hf.transformer.h)
    ]
    with torch.no_grad():
        hf(torch.tensor([PROMPT]))
    for h in handles:
        h.remove()
    rows, values = [], []
    for layer in range(hf.config.n_layer):
        x = inputs[layer].astype(np.float64)
        c = x - x.mean(-1, keepdims=True)
        x_hat = c / np.sqrt((c**2).mean(-1, keepdims=True) + hf.config.layer_norm_epsilon)
        tc = {k: v.numpy().astype(np.float64) for k, v in tcs[layer].items()}
        pre = x_hat @ tc["W_enc"].T + tc["b_enc"]
        thr = tc.get("activation_function.threshold", np.zeros_like(tc["b_enc"]))
        act = np.where(pre > thr, pre, 0.0)
        act[0] = 0.0
        for pos, f in zip(*np.nonzero(act), strict=True):
            rows.append([layer, pos, f])
            values.append(act[pos, f])
    assert out["active_features"].tolist() == rows
    np.testing.assert_allclose(out["activation_values"].numpy(), values, rtol=1e-4, atol=1e-5)
    n_slots = hf.config.n_layer * (len(PROMPT) - 1) * tcs[0]["b_enc"].numel()
    assert 0.1 < len(rows) / n_slots < 0.4  # a graph of some size, not all or nothing
    assert out["selected_features"].tolist() == list(range(len(rows)))


def test_logit_nodes_are_the_top_tokens_to_095_capped_at_10(case):
    probs = case["clean"]["logits"][-1].detach().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep, total = [], 0.0
    for tok in order[:10]:
        keep.append(tok)
        total += float(probs[tok])
        if total >= 0.95:
            break
    out = case["out"]
    assert out["logit_tokens"].tolist() == keep
    np.testing.assert_allclose(out["logit_probabilities"].numpy(), probs[keep].numpy(), rtol=1e-4)
    # Each variant exercises its own end of the rule: the cap, or the 0.95 cut (past 1).
    assert (len(keep) == 10) == (case["name"] == "relu") and len(keep) > 1


def _frozen_rows(case, target_fn):
    """One adjacency row by autograd: the target scalar through the frozen forward (clean
    patterns and LN scales, MLP outputs constant, W_skip x̂ kept differentiable, a zero
    probe added to each MLP output to read ∂target/∂mlp_out), contracted with every source."""
    hf, tcs, clean, acts, out = case["hf"], case["tcs"], case["clean"], case["acts"], case["out"]
    n_layer, n_pos = hf.config.n_layer, len(PROMPT)
    probes = {i: torch.zeros(n_pos, hf.config.n_embd, requires_grad=True) for i in range(n_layer)}

    def mlp(layer, x_hat):
        const = clean["mlp_out"][layer].detach()
        if "W_skip" in tcs[layer]:
            skip = x_hat @ tcs[layer]["W_skip"].T
            return const + skip - skip.detach()
        return const

    rec = _forward(hf, torch.tensor(PROMPT), clean=clean, freeze_ln=True, mlp=mlp, add=probes)
    target = target_fn(rec)
    grads = torch.autograd.grad(
        target, [rec["embed"], *probes.values()], allow_unused=True, materialize_grads=True
    )
    g_embed, g_mlp = grads[0], grads[1:]
    row = []
    for layer, pos, f in out["active_features"].tolist():
        row.append(float(acts[layer, pos, f] * tcs[layer]["W_dec"][f] @ g_mlp[layer][pos]))
    for layer in range(n_layer):
        tc = tcs[layer]
        with torch.no_grad():
            recon = acts[layer] @ tc["W_dec"] + tc["b_dec"]
            if "W_skip" in tc:
                recon = recon + clean["x_hat"][layer] @ tc["W_skip"].T
            error = clean["mlp_out"][layer] - recon
        error[0] = 0
        row += (error * g_mlp[layer]).sum(-1).tolist()
    row += (hf.transformer.wte.weight[PROMPT].detach() * g_embed).sum(-1).tolist()
    return np.array(row + [0.0] * len(out["logit_tokens"]))


def test_logit_rows_are_demeaned_unembedding_gradients_of_the_frozen_model(case):
    out = case["out"]
    w_u = case["hf"].lm_head.weight.detach()  # [vocab, d_model]
    adjacency = out["adjacency_matrix"].numpy()
    n_logits = len(out["logit_tokens"])
    for k, tok in enumerate(out["logit_tokens"].tolist()):
        g = w_u[tok] - w_u.mean(0)
        expected = _frozen_rows(case, lambda rec, g=g: rec["final"][-1] @ g)
        got = adjacency[-n_logits + k]
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, atol=2e-5 * scale, rtol=1e-3)


def test_a_feature_row_is_the_encoder_gradient_of_the_frozen_model(case):
    """The last layer's most active feature at the last position: its row is ∂(W_enc[f]·x̂)
    for every source (features of lower layers, errors, tokens); nothing from its own layer."""
    out, tcs = case["out"], case["tcs"]
    last = case["hf"].config.n_layer - 1
    f = int(case["acts"][last, -1].argmax())
    index = out["active_features"].tolist().index([last, len(PROMPT) - 1, f])
    w_enc = tcs[last]["W_enc"][f]
    expected = _frozen_rows(case, lambda rec: rec["x_hat"][last][-1] @ w_enc)
    got = out["adjacency_matrix"][index].numpy()
    np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=1e-3)
    assert np.abs(got).max() > 0


def _influence(adjacency: np.ndarray, n_logits: int, probs: np.ndarray):
    a = np.abs(adjacency.astype(np.float64))
    a_hat = a / np.maximum(a.sum(1, keepdims=True), 1e-10)
    w = np.zeros(len(a))
    w[-n_logits:] = probs
    # w Â (I − Â)^-1 = w Â + w Â² + … (the graph is a DAG, so the series ends).
    return a_hat, w, np.linalg.solve((np.eye(len(a)) - a_hat).T, (w @ a_hat))


def test_scores_and_pruning_follow_from_the_adjacency(case):
    out = case["out"]
    n_f, n_layer, n_pos = len(out["selected_features"]), case["hf"].config.n_layer, len(PROMPT)
    n_logits = len(out["logit_tokens"])
    a_hat, w, infl = _influence(
        out["adjacency_matrix"].numpy(), n_logits, out["logit_probabilities"].numpy()
    )
    errors = slice(n_f, n_f + n_layer * n_pos)
    tokens = slice(errors.stop, errors.stop + n_pos)
    replacement = infl[tokens].sum() / (infl[tokens].sum() + infl[errors].sum())
    weight = infl + w
    completeness = ((1 - a_hat[:, errors].sum(1)) * weight).sum() / weight.sum()
    assert out["replacement_score"] == pytest.approx(replacement, rel=1e-4)
    assert out["completeness_score"] == pytest.approx(completeness, rel=1e-4)
    assert 0 < replacement < 1 and 0 < completeness < 1
    # cumulative_scores: each node's rank share of the total influence.
    order = np.argsort(-infl, kind="stable")
    cum = np.empty_like(infl)
    cum[order] = np.cumsum(infl[order]) / infl.sum()
    np.testing.assert_allclose(out["cumulative_scores"].numpy(), cum, atol=1e-4)
    mask = out["node_mask"].numpy()
    assert mask[tokens.start :].all()  # tokens and logits always kept
    kept = np.flatnonzero(mask[: tokens.start])
    assert 0 < len(kept) < tokens.start
    # A kept feature/error node lies within the node_threshold share of influence.
    assert (cum[kept] <= 0.8 + 1e-4 + infl[kept] / infl.sum()).all()
    edges = out["edge_mask"].numpy()
    assert not edges[~mask].any() and not edges[:, ~mask].any()


def test_graph_json_links_are_adjacency_entries_of_kept_edges(case):
    out = case["out"]
    n_f, n_layer, n_pos = len(out["selected_features"]), case["hf"].config.n_layer, len(PROMPT)
    ids = []
    for layer, pos, f in out["active_features"].tolist():
        ids.append(f"{layer}_{f}_{pos}")
    ids += [f"0_{layer}_{pos}" for layer in range(n_layer) for pos in range(n_pos)]
    ids += [f"E_{tok}_{pos}" for pos, tok in enumerate(PROMPT)]
    ids += [f"{n_layer + 1}_{tok}_{n_pos - 1}" for tok in out["logit_tokens"].tolist()]
    # circuit-tracer's ids are ambiguous: error (l, p) is "0_{l}_{p}", as is layer 0's
    # feature l at p. A link then stands for any of its ids' nodes.
    index: dict[str, list[int]] = {}
    for i, node_id in enumerate(ids):
        index.setdefault(node_id, []).append(i)
    links = out["graph_json"]["links"]
    adjacency, edges = out["adjacency_matrix"].numpy(), out["edge_mask"].numpy()
    assert len(links) == int(edges.sum()) > 0
    for link in links:
        pairs = [(t, s) for t in index[link["target"]] for s in index[link["source"]]]
        weights = [float(adjacency[t, s]) for t, s in pairs if edges[t, s]]
        assert link["weight"] in [pytest.approx(w, rel=1e-6, abs=1e-9) for w in weights]
    # Nodes: the kept ones touching a kept edge, and every token and logit node.
    mask = out["node_mask"].numpy()
    first_token = n_f + n_layer * n_pos
    expected = {
        ids[i]
        for i in np.flatnonzero(mask)
        if i >= first_token or edges[:, i].any() or edges[i].any()
    }
    assert {node["node_id"] for node in out["graph_json"]["nodes"]} == expected


def test_intervention_is_frozen_patterns_plus_the_decoder_delta(case):
    hf, tcs, clean, acts = case["hf"], case["tcs"], case["clean"], case["acts"]
    ((layer, pos, f, value),) = case["spec"]["interventions"]
    delta = torch.zeros(len(PROMPT), hf.config.n_embd)
    # Layer 0's input does not change under the intervention, so the act it recomputes is
    # the clean one.
    delta[pos] = (value - acts[layer, pos, f]) * tcs[layer]["W_dec"][f]
    with torch.no_grad():
        rec = _forward(hf, torch.tensor(PROMPT), clean=clean, add={layer: delta})
        plain = _forward(hf, torch.tensor(PROMPT))
    got = case["out"]["intervention_logits"]
    np.testing.assert_allclose(got.numpy(), rec["logits"][-1].numpy(), atol=1e-4)
    assert (got - plain["logits"][-1]).abs().max() > 1e-3  # the intervention did something


def test_max_feature_nodes_takes_the_most_influential_features_first(case, tmp_path):
    """40 of the features, in batches of 8: the first 4 * 8 = 32 are the top features by
    influence through the logit rows alone, the last 8 the top ones of the rest once those
    32 rows count too; every row and column kept is the full graph's (a direct effect does not
    depend on which other nodes are in the graph)."""
    spec = {k: v for k, v in case["spec"].items() if k != "interventions"}
    part = run_reference(spec | {"max_feature_nodes": 40, "batch_size": 8}, tmp_path)
    full = case["out"]
    n = len(full["active_features"])
    n_logits = len(full["logit_tokens"])
    selected = part["selected_features"]
    assert len(selected) == 40 and selected.tolist() == sorted(set(selected.tolist()))
    assert torch.equal(part["active_features"], full["active_features"])
    a_full = full["adjacency_matrix"]
    cols = torch.cat([selected, torch.arange(n, a_full.shape[1])])
    got = part["adjacency_matrix"]
    assert got.shape == (len(cols), len(cols))
    torch.testing.assert_close(got[:40], a_full[selected][:, cols], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[-n_logits:], a_full[-n_logits:][:, cols], rtol=1e-4, atol=1e-6)
    assert not got[40:-n_logits].any()
    # The selection replayed on the full graph's rows: the top 32 by influence through the
    # logit rows, then the top 8 of the rest by influence through those rows too.
    a = a_full.double().abs().numpy()
    logit_nodes = list(range(len(a) - n_logits, len(a)))
    visited: list[int] = []
    for queue in (32, 8):
        rows = logit_nodes + visited
        a_hat = a[rows] / np.maximum(a[rows].sum(1, keepdims=True), 1e-8)
        prod = np.zeros(len(a))
        prod[logit_nodes] = full["logit_probabilities"].numpy()
        influence = np.zeros(len(a))
        while True:
            prod = prod[rows] @ a_hat
            if not prod.any():
                break
            influence += prod
        ranked = [int(i) for i in np.argsort(-influence[:n], kind="stable") if i not in visited]
        visited += ranked[:queue]
    assert selected.tolist() == sorted(visited)


def _threshold(scores: np.ndarray, share: float) -> float:
    """The score at which the sorted scores' running share first reaches `share`."""
    ordered = np.sort(scores)[::-1]
    running = np.cumsum(ordered) / ordered.sum()
    return ordered[min(int(np.searchsorted(running, share)), len(ordered) - 1)]


def test_prune_masks_are_the_documented_rule(case):
    """prune_graph's masks recomputed in numpy (float64) from the adjacency by the rule in
    graph_models.py: node share, edge share on the pruned graph, then the fixpoint."""
    out, spec = case["out"], case["spec"]
    n_logits, n_pos = len(out["logit_tokens"]), len(PROMPT)
    n_f = len(out["selected_features"])
    probs = out["logit_probabilities"].numpy()
    adjacency = out["adjacency_matrix"].numpy().astype(np.float64)
    _, w, influence = _influence(adjacency, n_logits, probs)
    node = influence >= _threshold(influence, spec["node_threshold"])
    node[-n_logits - n_pos :] = True
    pruned = adjacency.copy()
    pruned[~node] = 0
    pruned[:, ~node] = 0
    pruned_hat, _, pruned_influence = _influence(pruned, n_logits, probs)
    scores = pruned_hat * (pruned_influence + w)[:, None]
    edge = scores >= _threshold(scores.ravel(), spec["edge_threshold"])
    inner = slice(0, len(node) - n_logits - n_pos)  # features and errors
    while True:
        before = node.copy()
        node[inner] &= edge[:, inner].any(0)
        node[:n_f] &= edge[:n_f].any(1)
        edge[~node] = False
        edge[:, ~node] = False
        if (node == before).all():
            break
    assert (out["node_mask"].numpy() == node).all()
    assert (out["edge_mask"].numpy() == edge).all()


def test_hookrun_rows_are_the_frozen_model_gradients(case):
    """The issue's hand check on hookrun's side: its logit rows and a last-layer feature's
    row (experiment=attribution_graph's computation) equal the gradients through the frozen
    forward written here, independently of circuit-tracer."""
    import transformers

    from hookrun.dictionaries.load import load_dictionaries
    from hookrun.stages.graph.attribution import attribute
    from hookrun.stages.graph.replacement import Replacement

    spec = case["spec"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(spec["model"], attn_implementation="eager")
    tcs = load_dictionaries(spec["transcoders"], "graph.transcoders")
    tokens = torch.tensor(PROMPT)
    frozen, logits = Replacement.capture(hf.eval(), tokens, tcs, ["pre_affine"] * len(tcs))
    graph = attribute(
        frozen, tokens, logits, max_logits=10, probability=0.95, batch=4, max_features=None
    )
    adjacency = graph.dense().numpy()
    w_u = case["hf"].lm_head.weight.detach()
    k = len(graph.logit_tokens)
    for i, tok in enumerate(graph.logit_tokens.tolist()):
        g = w_u[tok] - w_u.mean(0)
        expected = _frozen_rows(case, lambda rec, g=g: rec["final"][-1] @ g)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(adjacency[-k + i], expected, atol=2e-5 * scale, rtol=1e-3)
    last = case["hf"].config.n_layer - 1
    f = int(case["acts"][last, -1].argmax())
    index = graph.features.tolist().index([last, len(PROMPT) - 1, f])
    w_enc = case["tcs"][last]["W_enc"][f]
    expected = _frozen_rows(case, lambda rec: rec["x_hat"][last][-1] @ w_enc)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(adjacency[index], expected, atol=2e-5 * scale, rtol=1e-3)
