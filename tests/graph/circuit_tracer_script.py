"""Run by `.venv-circuit-tracer`'s python (tests/reference_venvs.py: circuit-tracer 0.5.0,
transformers 4.57, transformer-lens 3.x), never imported by hookrun or the main venv's tests:
circuit-tracer's attribution graph of a GPT-2 saved by HF and per-layer transcoders.

    python circuit_tracer_script.py SPEC.json OUT.pt

SPEC.json: {"model": HF GPT2LMHeadModel folder (save_pretrained, with a tokenizer),
"transcoders": folder of layer_<i>.safetensors + config.yaml (circuit-tracer's format),
"tokens": prompt ids (the first must be a special id; see below), "max_n_logits",
"desired_logit_prob", "batch_size", "max_feature_nodes" (null: all), "node_threshold",
"edge_threshold", optional "interventions": [[layer, pos, feature, value], ...], optional
"intervention_sets": a list of such lists}.

OUT.pt (torch.save, plain tensors/floats/lists/dicts): the Graph's "input_tokens",
"active_features" (n, 3) [layer, pos, feature], "activation_values", "selected_features",
"adjacency_matrix" (dense float32, circuit-tracer's node order), "logit_tokens",
"logit_probabilities"; prune_graph's "node_mask", "edge_mask", "cumulative_scores";
compute_graph_scores' "replacement_score", "completeness_score"; "graph_json" (what
create_graph_files writes, loaded back); "intervention_logits" (last position, when SPEC has
interventions, freeze_attention=True as circuit-tracer's default); "intervention_set_logits"
(K, V) the same for each of "intervention_sets"; "tl_vs_hf_max_abs" (the
largest |TL − HF| logit on the prompt). The semantics of all of it: graph_models.py's docstring.

No hub access (HF_HUB_OFFLINE=1 before any import):
- the TransformerLens model is built from the HF config and weights in the folder
  (HookedTransformerConfig by hand, transformer_lens's convert_gpt2_weights, no fold_ln /
  centering / processing), then wrapped by `ReplacementModel.from_config`; the HF weights are
  loaded after the wrapping, under the wrapped names (blocks.i.mlp.old_mlp.*,
  unembed.old_unembed.*), since from_config builds and wraps in one step;
- the tokenizer is `AutoTokenizer.from_pretrained(model folder)` and `cfg.tokenizer_name` is the
  folder, so create_graph_files' own AutoTokenizer call loads it from disk too;
- the transcoders load through circuit-tracer's `load_transcoders` (hf_utils) with the
  config.yaml's layer files made absolute paths in the folder (no "hf://" entries).
circuit-tracer prepends a special token to a prompt whose first id is not special
(ensure_tokenized); the script refuses such a prompt rather than let the two sides' positions
differ.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402


def _tl_config(hf_cfg, folder: Path):
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        d_model=hf_cfg.n_embd,
        d_head=hf_cfg.n_embd // hf_cfg.n_head,
        n_heads=hf_cfg.n_head,
        d_mlp=hf_cfg.n_inner or 4 * hf_cfg.n_embd,
        n_layers=hf_cfg.n_layer,
        n_ctx=hf_cfg.n_positions,
        d_vocab=hf_cfg.vocab_size,
        act_fn=hf_cfg.activation_function,
        eps=hf_cfg.layer_norm_epsilon,
        normalization_type="LN",
        positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel",
        model_name=folder.name,
        tokenizer_name=str(folder),
        default_prepend_bos=False,
        device="cpu",
        dtype=torch.float32,
    )


def _transcoders(folder: Path):
    from circuit_tracer.utils.hf_utils import load_transcoders

    config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    config["transcoders"] = [
        str(p if Path(p).is_absolute() else folder / p) for p in config["transcoders"]
    ]
    config.setdefault("scan", folder.name)
    return load_transcoders(config, device=torch.device("cpu"), dtype=torch.float32)


def _model(folder: Path, transcoders):
    """The replacement model holding exactly the HF weights, and the HF model itself."""
    import transformers
    from circuit_tracer import ReplacementModel
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    cfg = _tl_config(hf.config, folder)
    model = ReplacementModel.from_config(cfg, transcoders, tokenizer=tokenizer)
    state = {}
    for key, value in convert_gpt2_weights(hf, cfg).items():
        key = key.replace(".mlp.", ".mlp.old_mlp.")
        key = key.replace("unembed.", "unembed.old_unembed.")
        state[key] = value.detach().clone()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    # Buffers (masks) and b_U (GPT-2 has none: zeros) are all the HF weights leave unset.
    left = [k for k in missing if not k.endswith(("mask", "IGNORE", "b_U"))]
    left = [k for k in left if not k.startswith("transcoders.")]
    assert not left, left
    return model, hf


def main(spec_path: str, out_path: str) -> None:
    from circuit_tracer import attribute
    from circuit_tracer.graph import compute_graph_scores, prune_graph
    from circuit_tracer.utils.create_graph_files import create_graph_files

    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    folder = Path(spec["model"]).resolve()
    model, hf = _model(folder, _transcoders(Path(spec["transcoders"]).resolve()))
    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    if not torch.equal(model.ensure_tokenized(tokens.clone()), tokens):
        raise SystemExit(f"tokens: {spec['tokens'][:4]}... would get a special token prepended")

    with torch.no_grad():
        tl_logits = model(tokens[None])
        hf_logits = hf(tokens[None]).logits
    graph = attribute(
        tokens,
        model,
        max_n_logits=spec["max_n_logits"],
        desired_logit_prob=spec["desired_logit_prob"],
        batch_size=spec["batch_size"],
        max_feature_nodes=spec["max_feature_nodes"],
    )
    node_mask, edge_mask, cumulative = prune_graph(
        graph, spec["node_threshold"], spec["edge_threshold"]
    )
    replacement, completeness = compute_graph_scores(graph)
    with tempfile.TemporaryDirectory() as tmp:
        create_graph_files(
            graph,
            slug="reference",
            output_path=tmp,
            node_threshold=spec["node_threshold"],
            edge_threshold=spec["edge_threshold"],
        )
        graph_json = json.loads((Path(tmp) / "reference.json").read_text(encoding="utf-8"))
    out = {
        "input_tokens": graph.input_tokens.cpu(),
        "active_features": graph.active_features.cpu().long(),
        "activation_values": graph.activation_values.cpu().float(),
        "selected_features": graph.selected_features.cpu().long(),
        "adjacency_matrix": graph.adjacency_matrix.cpu().float(),
        "logit_tokens": graph.logit_token_ids.cpu(),
        "logit_probabilities": graph.logit_probabilities.cpu().float(),
        "node_mask": node_mask.cpu(),
        "edge_mask": edge_mask.cpu(),
        "cumulative_scores": cumulative.cpu().float(),
        "replacement_score": float(replacement),
        "completeness_score": float(completeness),
        "graph_json": graph_json,
        "tl_vs_hf_max_abs": float((tl_logits - hf_logits).abs().max()),
    }
    if spec.get("interventions"):
        interventions = [tuple(i) for i in spec["interventions"]]
        logits, _ = model.feature_intervention(tokens, interventions)
        out["intervention_logits"] = logits[0, -1].cpu().float()
    if spec.get("intervention_sets"):
        out["intervention_set_logits"] = torch.stack(
            [
                model.feature_intervention(tokens, [tuple(i) for i in edits])[0][0, -1].float()
                for edits in spec["intervention_sets"]
            ]
        )
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
