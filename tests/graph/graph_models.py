"""Small GPT-2s, per-layer transcoders and circuit-tracer 0.5.0's graph of them, for the tests of
attribution graphs (issue 46). `save_gpt2` and `write_transcoders` write what both sides read;
`run_reference` runs circuit_tracer_script.py in `.venv-circuit-tracer` (tests/reference_venvs.py)
and returns its OUT.pt. Nothing of circuit-tracer is imported here.

# What circuit-tracer 0.5.0 computes (read from attribute.py, context_transformerlens.py,
# replacement_model_transformerlens.py, single_layer_transcoder.py, targets.py, graph.py)

Notation: L layers, T prompt positions (position 0 included), K logit nodes, n active features,
F selected features (F = n unless max_feature_nodes < n). A model in TransformerLens with no
weight processing (no fold_ln, no centering), so its logits are HF's.

**Prompt.** `ensure_tokenized` prepends a special token (bos, else pad, else eos) unless the
first id already is a special id; the script refuses prompts that would be changed, so
"input_tokens" is SPEC's "tokens". Position 0 is treated as BOS: its transcoder activations are
set to 0 (`zero_positions = slice(0, 1)`, every non-Gemma-3-it model) and its error vectors too.

**Transcoder input.** `ln2.hook_normalized` in TransformerLens's LayerNorm is
`(x - mean(x)) / sqrt(var(x) + eps)` BEFORE ln_2's weight and bias (TL's `LayerNorm.forward`
returns `hook_normalized(x / scale) * w + b`). It equals the HF `ln_2` output only when ln_2 has
weight 1 and bias 0 (HF's initialisation; `save_gpt2(..., ln_affine=False)`); with random LN
affines (`ln_affine=True`) the transcoders read the pre-affine normalised residual. Feature
output hook: `hook_mlp_out` (the MLP's output incl. c_proj's bias).

**Active features.** acts = act_fn(x̂ @ W_enc.T + b_enc) per layer (act_fn: ReLU, or JumpReLU
`x * (x > threshold)` when the file has `activation_function.threshold`), position 0 zeroed;
`active_features` are the nonzero entries as (layer, pos, feature) in lexicographic order (a
coalesced sparse tensor), `activation_values` their values.

**Error nodes.** error[l, p] = mlp_out[l, p] − (Σ_f acts[l, p, f] W_dec[f] + b_dec + W_skip x̂)
(the real MLP output minus the full reconstruction, b_dec and skip included); error[l, 0] = 0.
**Token nodes.** W_E[token_p] (token embedding only; positional embeddings, all biases, b_dec
and b_enc are constants, not nodes).

**The linear (frozen) model every edge is taken in.** Attention patterns detached
(`hook_pattern`), every LayerNorm scale detached (ln1, ln2, ln_final `hook_scale`; the mean
subtraction and the LN weight stay in the gradient), and each MLP's output replaced in the
backward pass by `skip + (mlp_out - skip).detach()` with skip = 0 (no W_skip: no gradient goes
through any MLP or transcoder at all) or W_skip x̂ (gradient flows through the skip only). The
gradient therefore runs along the residual stream and the attention value/output paths.

**Adjacency** `A[target, source]` (rows: targets, columns: sources), square, node order
`[selected features (F, ascending active_features index), errors (L*T, index F + l*T + p),
tokens (T), logits (K, descending probability)]`. Error and token rows are zero (no inputs);
logit columns are zero. The entry is the source vector contracted with the gradient of the
target's scalar at the source's hook:
- source feature (l, p, f) with activation a: `a * W_dec[f] · ∂target/∂mlp_out[l, p]`;
- source error (l, p): `error[l, p] · ∂target/∂mlp_out[l, p]`;
- source token p: `W_E[token_p] · ∂target/∂embed[p]` (hook_embed, before the pos embedding).
Target scalars:
- logit node k (token v_k): `g_k · ln_final(resid_final)[T-1]` with
  `g_k = W_U[:, v_k] − mean_over_vocab(W_U)` (the demeaned unembedding column; b_U ignored),
  injected at the ln_final OUTPUT (post-affine); i.e. the demeaned logit of v_k;
- feature node (l, p, f): `W_enc[f] · x̂_l[p]`, the feature's pre-activation minus b_enc, taken
  at ln2.hook_normalized of layer l (the raw encoder row, NOT scaled by the activation, no
  activation-function derivative). So features/errors of layer ≥ l have zero edges into it.
No edge is computed for sources other than those nodes.

**Logit nodes.** probs = softmax(logits[last position]) of the plain model; the top
max_n_logits by probability, cut at `searchsorted(cumsum(top_p), desired_logit_prob) + 1`
(the smallest prefix whose cumulative probability reaches desired_logit_prob, capped at
max_n_logits). `logit_probabilities` are those probabilities, not renormalised.

**Which features get rows.** max_feature_nodes None or ≥ n: all n, F = n. Otherwise, after the
logit rows, repeatedly: partial influences from the rows so far (|A| row-normalised, power
iteration from the logit probabilities), the not-yet-visited features ranked by influence,
the next min(4 * batch_size, remaining) of them get rows (in batches of batch_size); until
max_feature_nodes are visited. selected_features = the visited indices, ascending; only their
columns are kept. (The ranking depends on batch_size through the 4 * batch_size refresh.)

**Influence.** `Â = |A| / clamp(rowsum |A|, 1e-10)` (each target's incoming weights sum to 1);
`w` = zeros with the last K entries = logit_probabilities; `influence = w Â + w Â² + …` (until
it is zero: the graph is a DAG).

**prune_graph(node_threshold, edge_threshold).** find_threshold(s, t): s sorted descending, the
value at index `min(searchsorted(cumsum(s) / sum(s), t), len - 1)`. node_mask = influence ≥
find_threshold(influence, node_threshold), then tokens and logits forced True. pruned = A with
the rows and columns of dropped nodes zeroed; edge_scores = Â_pruned * (influence_pruned +
w)[:, None] (Â_pruned and influence_pruned recomputed on pruned); edge_mask = edge_scores ≥
find_threshold(edge_scores.flatten(), edge_threshold). Then to a fixpoint: a feature or error
node with no kept outgoing edge is dropped, a feature node with no kept incoming edge is
dropped, and every edge of a dropped node is dropped. cumulative_scores[i] = the share of
total influence (unpruned) of the nodes ranked at or above node i by influence (descending).

**compute_graph_scores.** With Â, influence and w of the full graph:
replacement = Σ influence[tokens] / (Σ influence[tokens] + Σ influence[errors]);
completeness = Σ_i (1 − Σ_errors Â[i, errors]) (influence_i + w_i) / Σ_i (influence_i + w_i)
(all-zero rows, i.e. errors and tokens, count as fully explained).

**feature_intervention(tokens, [(layer, pos, feature, value)], freeze_attention=True).** A clean
run caches every layer's attention pattern; the intervened run uses those patterns (LN scales
are NOT frozen, MLPs run for real), recomputes the intervened layer's transcoder activations on
its current input (position 0 reads 0) and adds `(value − act) * W_dec[feature]` to that
layer's hook_mlp_out at pos; later layers react through their real MLPs.
"intervention_logits" = the resulting logits at the last position.

**graph_json** (create_graph_files): nodes kept by node_mask that touch a kept edge, plus all
token and logit nodes; node ids: feature `"{layer}_{feature}_{pos}"`, error
`"0_{layer}_{pos}"`, token `"E_{token_id}_{pos}"`, logit `"{L+1}_{token_id}_{T-1}"`; links
`{source, target, weight = A[target, source]}` for kept edges. The ids are ambiguous: error
(l, p) and layer 0's feature l at p are both `"0_{l}_{p}"` (create_graph_files keys its nodes by
index, so both appear; a link names either).

**What is checked, what only read.** test_circuit_tracer_reference.py confirms against
independent computations (HF hooks, numpy, autograd through a hand-written frozen GPT-2): the
transcoder input and active features (with random LN affines, JumpReLU and W_skip), the error
and token source vectors, whole logit rows and a feature row, the logit selection (both the
cap and the 0.95 cut), the scores and cumulative_scores, the JSON links, the intervention, and
the max_feature_nodes selection (replayed: 40 features in batches of 8 pick 1-3 features
other than the plain top 40 by logit-row influence, so the re-ranking matters); prune_graph's
node and edge masks equal a numpy reimplementation of the rule above, bit for bit. The script
runs float32 on the CPU: rows agree with autograd to about 1e-6 of their largest entry.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import circuit_tracer_python  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("circuit_tracer_script.py")
# A real byte-level BPE (2048 ids, <|endoftext|> = 0 special) so circuit-tracer's decode and
# create_graph_files' AutoTokenizer load from the model folder, with no hub access.
TOKENIZER = ROOT / "hookrun" / "models" / "checkpoints" / "tiny_lm" / "tokenizer.json"
EOT = "<|endoftext|>"


def save_gpt2(
    folder: Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_positions: int = 64,
    seed: int = 0,
    ln_affine: bool = False,
    ln_f_scale: float = 1.0,
):
    """A GPT2LMHeadModel with seeded random weights and the tiny_lm tokenizer, saved to
    `folder` (save_pretrained plus tokenizer.json and a tokenizer_config.json transformers 4
    and 5 both read). Vocabulary: the tokenizer's 2048 ids, id 0 = <|endoftext|> (special,
    so a prompt starting with 0 is not changed by circuit-tracer).

    `ln_affine`: random LayerNorm weights and biases instead of HF's 1 and 0 (then the
    transcoder input ln2.hook_normalized differs from the ln_2 output; see above).
    `ln_f_scale`: ln_f's weight multiplied by it, sharpening the next-token distribution
    (random weights give a near-uniform one, where the logit nodes are always the top
    max_n_logits; about 40 makes desired_logit_prob cut earlier).

    Returns:
        The model (eval mode, float32).
    """
    import transformers

    vocab = len(json.loads(TOKENIZER.read_text(encoding="utf-8"))["model"]["vocab"])
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_ln = ".ln_" in name or name.startswith("transformer.ln_f")
            if name.endswith("bias") and not is_ln:
                # HF zero-initialises biases: random ones make a bias-handling slip visible.
                p.normal_(0.0, 0.02)
            elif ln_affine and is_ln and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif ln_affine and is_ln:
                p.normal_(0.0, 0.1)
        model.transformer.ln_f.weight.mul_(ln_f_scale)
    _save(model, folder, n_positions)
    return model


def _save(model, folder: Path, positions: int) -> None:
    """The model saved by save_pretrained with the tiny_lm tokenizer beside it (a
    tokenizer_config.json transformers 4 and 5 both read)."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    shutil.copyfile(TOKENIZER, folder / "tokenizer.json")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "model_max_length": positions,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg), encoding="utf-8")


def save_llama(folder: Path, *, n_layer: int = 2, seed: int = 0):
    """A LlamaForCausalLM with seeded random weights (hidden 64, 4 query heads sharing 2
    value heads, RMSNorm weights around 1, untied unembedding) and the tiny_lm tokenizer,
    saved to `folder` as save_gpt2 saves a GPT-2.

    Returns:
        The model (eval mode, float32, eager attention).
    """
    import transformers

    vocab = len(json.loads(TOKENIZER.read_text(encoding="utf-8"))["model"]["vocab"])
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
    _save(model, folder, 64)
    return model


def write_transcoders(
    folder: Path,
    model,
    *,
    d_tc: int = 96,
    seed: int = 1,
    threshold: float | None = None,
    skip: bool = False,
) -> dict[int, dict[str, torch.Tensor]]:
    """Random circuit-tracer per-layer transcoders for every layer of `model` (a GPT-2 from
    `save_gpt2`), written to `folder` as circuit-tracer's loader reads them: layer_<i>.safetensors
    (W_enc [d_tc, d_model], W_dec [d_tc, d_model], b_enc [d_tc], b_dec [d_model], with
    `threshold` also activation_function.threshold [d_tc] (JumpReLU), with `skip` W_skip
    [d_model, d_model]) and config.yaml (model_kind transcoder_set, feature_input_hook
    ln2.hook_normalized, feature_output_hook hook_mlp_out, the layer files in order).

    Encoder rows have unit norm, so on the unit-variance normalised residual a pre-activation
    is about N(0, 1); b_enc = -0.5 (with `threshold` t: b_enc = -0.5 + t) leaves roughly 30 %
    of the features active, with no data needed to calibrate.

    Returns:
        {layer: that layer's tensors}, as written.
    """
    from safetensors.torch import save_file

    d_model = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    layers = {}
    for layer in range(model.config.num_hidden_layers):
        w_enc = torch.randn(d_tc, d_model, generator=gen)
        w_enc /= w_enc.norm(dim=1, keepdim=True)
        shift = 0.0 if threshold is None else threshold
        tensors = {
            "W_enc": w_enc,
            "W_dec": 0.1 * torch.randn(d_tc, d_model, generator=gen),
            "b_enc": -0.5 + shift + 0.1 * torch.randn(d_tc, generator=gen),
            "b_dec": 0.05 * torch.randn(d_model, generator=gen),
        }
        if threshold is not None:
            tensors["activation_function.threshold"] = torch.full((d_tc,), float(threshold))
        if skip:
            tensors["W_skip"] = 0.05 * torch.randn(d_model, d_model, generator=gen)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, folder / f"layer_{layer}.safetensors"
        )
        layers[layer] = tensors
    files = "".join(f"  - layer_{i}.safetensors\n" for i in range(model.config.num_hidden_layers))
    (folder / "config.yaml").write_text(
        "model_kind: transcoder_set\n"
        "scan: hookrun-tests\n"
        "feature_input_hook: ln2.hook_normalized\n"
        "feature_output_hook: hook_mlp_out\n"
        f"transcoders:\n{files}",
        encoding="utf-8",
    )
    return layers


def run_reference(spec: dict, tmp_path: Path) -> dict:
    """circuit-tracer's graph for `spec` (the keys of docs in circuit_tracer_script.py: model,
    transcoders, tokens, max_n_logits, desired_logit_prob, batch_size, max_feature_nodes,
    node_threshold, edge_threshold, optional interventions), computed by
    circuit_tracer_script.py in `.venv-circuit-tracer` (built on first use).

    Returns:
        OUT.pt's dict (tensors, floats, lists; "graph_json" a dict).

    Raises:
        AssertionError: the script failed (its stderr's tail in the message).
    """
    spec_path = tmp_path / "ct_spec.json"
    out = tmp_path / "ct_out.pt"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    args = [str(circuit_tracer_python()), str(SCRIPT), str(spec_path), str(out)]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)
