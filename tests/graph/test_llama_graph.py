"""experiment=attribution_graph on a Hugging Face Llama (RMSNorm, grouped-query attention, a
gated MLP replaced by its transcoder), checked by hand: the frozen forward is written here
from the model's weights (the attention patterns and MLP outputs taken from HF's own clean
pass, each RMSNorm's scale computed here and held, the value heads shared as repeat_kv
shares them), and its gradients are the reference for the logit rows and a last-layer
feature's row; the active features, the errors and an intervention's logits are computed
here too. Nothing of circuit-tracer is used (its TransformerLens wrapping is GPT-2's in
circuit_tracer_script.py)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from graph_models import save_llama, write_transcoders

import hookrun

PROMPT = "def add(a, b): return a"


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    hf = save_llama(tmp / "model", n_layer=2)
    written = write_transcoders(tmp / "tc", hf, seed=3)
    tcs = [written[i] for i in sorted(written)]
    (tmp / "prompts.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n", encoding="utf-8")
    args = [
        "experiment=attribution_graph",
        "model=hf",
        f"model.path={tmp / 'model'}",
        f"dataset.path={tmp / 'prompts.jsonl'}",
        f"graph.transcoders={tmp / 'tc'}",
        "graph.batch=16",
        "progress=false",
        "render=false",
        "graph.interventions=[{layer:0,position:-1,latents:[LATENT],op:scale,value:3.0}]",
    ]
    # the intervention's latent: layer 0's most active at the last position, found below
    with h5py.File(hookrun.run(args[:-1], run_dir=tmp / "clean").path, "r") as f:
        g = f["graph/0"]
        tokens = torch.from_numpy(g["tokens"][()])
        features, acts = g["features"][()], g["activations"][()]
    last = len(tokens) - 1
    mine = (features[:, 0] == 0) & (features[:, 1] == last)
    latent = int(features[mine][np.argmax(acts[mine]), 2])
    args[-1] = args[-1].replace("LATENT", str(latent))
    path = hookrun.run(args, run_dir=tmp / "run").path
    return {"hf": hf, "tcs": tcs, "tokens": tokens, "path": path, "latent": latent}


def _clean(hf, tokens):
    """HF's own clean pass: the patterns, each norm's input and each MLP's output."""
    seen = {}

    def keep(name):
        def hook(module, args, output):
            seen[name] = (args[0][0].detach(), output[0].detach())

        return hook

    handles = []
    for i, layer in enumerate(hf.model.layers):
        for part in ("input_layernorm", "post_attention_layernorm", "mlp"):
            handles.append(getattr(layer, part).register_forward_hook(keep(f"{i}.{part}")))
    handles.append(hf.model.norm.register_forward_hook(keep("norm")))
    try:
        with torch.no_grad():
            out = hf(input_ids=tokens[None], output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    seen["patterns"] = [a[0] for a in out.attentions]
    seen["logits"] = out.logits[0]
    return seen


def _scale(x, norm):
    return (x.pow(2).mean(-1) + norm.variance_epsilon).sqrt()


def _mix(attn, h, pattern):
    """The attention's output on h (T, d) under a fixed pattern (H, T, T)."""
    heads, kv = pattern.shape[0], attn.config.num_key_value_heads
    v = attn.v_proj(h).view(len(h), kv, -1).transpose(0, 1).repeat_interleave(heads // kv, 0)
    return attn.o_proj((pattern @ v).transpose(0, 1).reshape(len(h), -1))


def _acts(tc, x_hat):
    acts = torch.relu(x_hat @ tc["W_enc"].T + tc["b_enc"])
    acts[0] = 0  # the beginning of the text
    return acts


def _frozen_rows(case, clean, target):
    """Each source's direct effect on target(record) through the frozen model, in hookrun's
    node order (features by (layer, position, latent), errors, tokens)."""
    hf, tcs, tokens = case["hf"], case["tcs"], case["tokens"]
    t = len(tokens)
    embed = hf.model.embed_tokens.weight[tokens].detach().clone().requires_grad_(True)
    probes = [torch.zeros(t, hf.config.hidden_size, requires_grad=True) for _ in tcs]
    x, rec = embed, {"x_hat": []}
    for i, layer in enumerate(hf.model.layers):
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        s1 = _scale(clean[f"{i}.input_layernorm"][0], norm1)
        x = x + _mix(layer.self_attn, x / s1[:, None] * norm1.weight, clean["patterns"][i])
        s2 = _scale(clean[f"{i}.post_attention_layernorm"][0], norm2)
        rec["x_hat"].append(x / s2[:, None])
        x = x + clean[f"{i}.mlp"][1] + probes[i]
    sf = _scale(clean["norm"][0], hf.model.norm)
    rec["final"] = x / sf[:, None] * hf.model.norm.weight
    grads = torch.autograd.grad(target(rec), [*probes, embed], allow_unused=True)
    grads = [torch.zeros(t, hf.config.hidden_size) if g is None else g for g in grads]
    feats, errors = [], []
    for i, tc in enumerate(tcs):
        x_hat = (
            clean[f"{i}.post_attention_layernorm"][0]
            / _scale(
                clean[f"{i}.post_attention_layernorm"][0],
                hf.model.layers[i].post_attention_layernorm,
            )[:, None]
        )
        acts = _acts(tc, x_hat)
        pos, lat = torch.nonzero(acts, as_tuple=True)
        feats.append((acts[pos, lat][:, None] * tc["W_dec"][lat] * grads[i][pos]).sum(-1))
        error = clean[f"{i}.mlp"][1] - (acts @ tc["W_dec"] + tc["b_dec"])
        error[0] = 0
        errors.append((error * grads[i]).sum(-1))
    tokens_row = (embed.detach() * grads[-1]).sum(-1)
    return torch.cat([*feats, *errors, tokens_row]).detach().numpy()


def _dense(g):
    crow, col, val = (g[k][()] for k in ("adjacency_crow", "adjacency_col", "adjacency_val"))
    n = crow.size - 1
    dense = np.zeros((n, n), np.float32)
    dense[np.repeat(np.arange(n), np.diff(crow)), col] = val
    return dense


def test_llama_graph_rows_are_the_frozen_models_gradients(case):
    hf, tcs, tokens = case["hf"], case["tcs"], case["tokens"]
    clean = _clean(hf, tokens)
    with h5py.File(case["path"], "r") as f:
        g = f["graph/0"]
        adjacency, features = _dense(g), g["features"][()]
        logit_tokens = g["logit_tokens"][()]
        np.testing.assert_allclose(g["logits"][()], clean["logits"][-1].numpy(), atol=1e-5)
    # the active features are the transcoders on the normalised input of each MLP's norm
    want = []
    for i, tc in enumerate(tcs):
        x = clean[f"{i}.post_attention_layernorm"][0]
        x_hat = x / _scale(x, hf.model.layers[i].post_attention_layernorm)[:, None]
        pos, lat = torch.nonzero(_acts(tc, x_hat), as_tuple=True)
        want += [[i, p, f] for p, f in zip(pos.tolist(), lat.tolist(), strict=True)]
    assert features.tolist() == want
    n_sources = len(want) + len(tcs) * len(tokens) + len(tokens)
    w_u = hf.lm_head.weight.detach()
    k = len(logit_tokens)
    for i, tok in enumerate(logit_tokens.tolist()):
        direction = w_u[tok] - w_u.mean(0)
        expected = _frozen_rows(case, clean, lambda rec, d=direction: rec["final"][-1] @ d)
        got = adjacency[n_sources + i, :n_sources]
        np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=1e-3)
    assert k >= 1
    last = len(tcs) - 1
    index = max(j for j, (layer, p, _) in enumerate(want) if layer == last and p == len(tokens) - 1)
    f = want[index][2]
    w_enc = tcs[last]["W_enc"][f]
    expected = _frozen_rows(case, clean, lambda rec: rec["x_hat"][last][-1] @ w_enc)
    got = adjacency[index, :n_sources]
    np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(), rtol=1e-3)
    assert np.abs(expected[: len(want)]).max() > 0  # a layer-0 feature reaches it


def test_llama_intervention_is_frozen_patterns_plus_the_decoder_delta(case):
    """Scale 3 of layer 0's latent at the last position: nothing before it changes, so its
    current activation is the clean one; the real MLPs and norms run, the patterns held."""
    hf, tcs, tokens, latent = case["hf"], case["tcs"], case["tokens"], case["latent"]
    clean = _clean(hf, tokens)
    x0 = clean["0.post_attention_layernorm"][0]
    a = _acts(tcs[0], x0 / _scale(x0, hf.model.layers[0].post_attention_layernorm)[:, None])
    delta = torch.zeros(len(tokens), hf.config.hidden_size)
    delta[-1] = (3.0 - 1.0) * a[-1, latent] * tcs[0]["W_dec"][latent]
    with torch.no_grad():
        x = hf.model.embed_tokens.weight[tokens]
        for i, layer in enumerate(hf.model.layers):
            x = x + _mix(layer.self_attn, layer.input_layernorm(x), clean["patterns"][i])
            out = layer.mlp(layer.post_attention_layernorm(x))
            x = x + out + (delta if i == 0 else 0)
        want = hf.lm_head(hf.model.norm(x))[-1]
    with h5py.File(case["path"], "r") as f:
        got = f["graph/0/intervention_logits"][()][0]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5 * float(want.abs().max()))
    assert np.abs(got - clean["logits"][-1].numpy()).max() > 1e-3  # it did something
