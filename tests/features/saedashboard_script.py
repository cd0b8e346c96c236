"""Run by the SAEDashboard venv's python (tests/reference_venvs.py: sae-dashboard 0.8.0,
sae-lens 6.54.0, transformer-lens 2.17), never imported by hookrun or by a test:
SAEDashboard's own runner (`SaeVisRunner(SaeVisConfig(...)).run`) over fixed token rows, for
a list of latents of one SAELens folder, through a TransformerLens HookedSAETransformer built
offline from the tiny GPT-2's HF checkpoint (tests/dictionaries/saelens_evals_script.py's
way: the config written from config.json, the weights converted by `convert_gpt2_weights`).

Usage: python saedashboard_script.py MODEL_DIR SAE_DIR TOKENS OUT_JSON LATENTS
           [--minibatch-tokens 64] [--minibatch-features 256] [--k 20] [--groups 5]
           [--per-group 5] [--logits 10] [--bins 50] [--bench]

TOKENS: a .npy of (N, T) token ids, every row T long (no padding). LATENTS: comma-separated
ids, or `all`. OUT_JSON: per latent SAEDashboard's numbers (below); with --bench only the
seconds the runner took and how many latents and tokens it saw.

The settings, each chosen so that SAEDashboard's output means what hookrun's features file
does (sae_dashboard/sae_vis_runner.py, sequence_data_generator.py, utils_fns.py):

- `SequencesConfig(buffer=None, compute_buffer=True)`, as SAEDashboard's own Neuronpedia
  runner sets it. With a buffer (b0, b1) SAEDashboard looks for maxima only in positions
  b0+1 .. T-b1-1 (`k_largest_indices(x[:, b0+1:-b1])`: the +1 keeps a previous token for
  its loss effect) — position 0 is always out and b1=0 gives an empty slice (`x[:, 1:-0]`),
  so no buffer means "every position". buffer=None makes every position of every row a
  candidate; each context is then the whole row less its position 0 (`token_ids` and
  `feat_acts` are indexed [:, 1:]); the maximum's own position is `qualifying_token_index`.
- `ignore_tokens=set()`, `ignore_positions=[]` (SaeVisConfig's defaults): every token
  counts. The Neuronpedia runner passes {pad, bos, eos} — it zeroes the latent there (the
  tokens stay in the density's denominator); the tiny tokenizer's bos = eos = pad = 0 is the
  packed corpus's separator, which hookrun's features job does not leave out.
- No BOS: the rows are given as token tensors, which TransformerLens never prepends to
  (prepend_bos applies to strings only), and `default_prepend_bos=False`.
- `fold_W_dec_norm`: SaeVisRunner.run calls `encoder.fold_W_dec_norm()` first (decoder rows
  made unit norm, the encoder scaled to keep W_dec's products). SAELens refuses it for a
  TopK SAE without `rescale_acts_by_decoder_norm` (NotImplementedError: it would change which
  k latents win), and the shipped tiny_lm_sae is such a SAE (decoder norms 0.15 .. 0.97).
  The SAE instance's fold_W_dec_norm is replaced by a no-op here, so SAEDashboard sees the
  SAE's own encode — what hookrun reports. For a ReLU/JumpReLU SAE SAEDashboard's values
  would be the SAE's times ‖W_dec[i]‖ and its logit effects divided by it.
- The model: every TransformerLens weight processing off but `fold_ln`: centring the writing
  weights changes the residual stream the SAE reads (blocks.1.hook_resid_post), while
  folding the layer norms does not (their gains and biases move into the next linear map);
  fold_ln puts ln_final into W_U as TransformerLens does for every pretrained model
  (`W_U ← diag(ln_final.w) W_U`, then centred over d_model). So SAEDashboard's logit effect
  (`W_dec[i] @ model.W_U`) is the decoder row through the final norm's linear part and the
  unembedding: ((d − mean(d)) ⊙ γ_f) @ W_U, no 1/σ, no bias. center_unembed is off: it
  would subtract each latent's mean logit over the vocabulary (the order unchanged).
- `minibatch_size_tokens`, `minibatch_size_features` as given (rows per forward pass,
  latents per pass over the corpus); `dtype="float32"`, `device="cpu"`, `seed=0`;
  `perform_ablation_experiments=False`, `use_dfa=False`.
- Layout: `top_acts_group_size=k` (SaeVisConfig's default is 20), `n_quantiles=groups`,
  `quantile_group_size=per_group`, histogram `n_bins=bins`, logits table `n_rows=logits`.

What SAEDashboard computes, as written out per latent:
- top: `feat_acts.flatten().topk(k)` over every (row, token) — torch.topk, ties in no set
  order; fewer than k positive values are filled with zeros at arbitrary places. Its
  contexts hold `round(act, 4)` (SequenceData.feat_acts) and leave out position 0, so the
  positions and unrounded values are recorded as get_indices_dict chose them (`_Chosen`);
  `top_displayed` is what SAEDashboard's own output holds.
- intervals: edges `linspace(0, max, groups+1)`; group i holds the positions with
  lower <= act <= upper (both ends, so the lowest group also holds every non-firing token
  and a value on an edge is in two groups), `per_group` of them drawn by python's
  random.sample (seeded), fewer if fewer exist. Listed here lowest group first.
- histogram: of the firing (act > 0) positions only, `torch.histc(bins)` over
  [min, max] of those values; `centres` are SAEDashboard's bar_values (rounded to 5 digits).
- density: fired positions / all positions (FeatureStatistics.frac_nonzero); max likewise.
- logits: the top and bottom `logits` entries of W_dec[i] @ W_U (LogitsTableData).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from sae_dashboard.components_config import (
    ActsHistogramConfig,
    Column,
    FeatureTablesConfig,
    LogitsHistogramConfig,
    LogitsTableConfig,
    SequencesConfig,
)
from sae_dashboard.layout import SaeVisLayoutConfig
from sae_dashboard.sae_vis_data import SaeVisConfig
from sae_dashboard.sae_vis_runner import SaeVisRunner
from sae_dashboard.sequence_data_generator import SequenceDataGenerator
from sae_lens import SAE, HookedSAETransformer
from transformer_lens import HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
from transformers import GPT2LMHeadModel


def hooked_gpt2(model_dir: Path) -> tuple[HookedSAETransformer, GPT2LMHeadModel]:
    """The tiny GPT-2 as a HookedSAETransformer with only its layer norms folded (see the
    docstring), and HF's model."""
    hf = GPT2LMHeadModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    c = hf.config
    cfg = HookedTransformerConfig(
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd,
        n_layers=c.n_layer,
        n_ctx=c.n_positions,
        d_vocab=c.vocab_size,
        act_fn=c.activation_function,
        eps=c.layer_norm_epsilon,
        normalization_type="LN",
        positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False,
        dtype=torch.float32,
        device="cpu",
    )
    model = HookedSAETransformer(cfg)
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf, cfg),
        fold_ln=True,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return model.eval(), hf


def _layout(args: argparse.Namespace) -> SaeVisLayoutConfig:
    return SaeVisLayoutConfig(
        columns=[
            Column(
                SequencesConfig(
                    stack_mode="stack-all",
                    buffer=None,
                    compute_buffer=True,
                    n_quantiles=args.groups,
                    top_acts_group_size=args.k,
                    quantile_group_size=args.per_group,
                ),
                ActsHistogramConfig(n_bins=args.bins),
                LogitsHistogramConfig(),
                LogitsTableConfig(n_rows=args.logits),
                FeatureTablesConfig(n_rows=3),
            )
        ]
    )


class _Chosen:
    """The positions SequenceDataGenerator.get_indices_dict picks for each latent, in call
    order (one call per latent, in the runner's order), with the activation there unrounded:
    SAEDashboard's contexts round it to 4 digits and, with buffer=None, leave out position 0
    (`feat_acts_buf[:, 1:]`), where a maximum may well be. Wrapping only records."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[np.ndarray, np.ndarray]]] = []
        original = SequenceDataGenerator.get_indices_dict

        def recording(generator, buffer, feat_acts):
            indices_dict, indices_bold, n_bold = original(generator, buffer, feat_acts)
            groups = []
            for indices in indices_dict.values():
                at = indices.long()
                groups.append((at.numpy(), feat_acts[at[:, 0], at[:, 1]].cpu().numpy()))
            self.calls.append(groups)
            return indices_dict, indices_bold, n_bold

        SequenceDataGenerator.get_indices_dict = recording


def _entries(group: tuple[np.ndarray, np.ndarray]) -> list[list]:
    at, values = group
    return [[float(v), int(r), int(t)] for (r, t), v in zip(at, values, strict=True)]


def _displayed(sequence_data) -> list[list]:
    """SAEDashboard's own top group as it stores it: [rounded value, row, token] (None
    where the maximum is at position 0, which its context leaves out)."""
    out = []
    for seq in sequence_data.seq_group_data[0].seq_data:
        at = seq.qualifying_token_index  # its contexts start at position 1 (buffer=None)
        out.append([seq.feat_acts[at - 1] if at else None, seq.original_index, at])
    return out


def main(args: argparse.Namespace) -> None:
    tokens = torch.from_numpy(np.load(args.tokens)).long()
    model, hf = hooked_gpt2(args.model_dir)
    sae = SAE.load_from_disk(str(args.sae_dir)).eval()
    # SaeVisRunner.run folds the decoder norms first, which SAELens refuses for this TopK
    # SAE: the docstring says why a no-op keeps SAEDashboard's numbers the SAE's own.
    sae.fold_W_dec_norm = lambda: None
    # SAELens 6.54 keeps only the metadata keys it knows: hookrun's folder has more, and
    # hook_name is lost with them, so it is read from cfg.json itself.
    hook = json.loads((args.sae_dir / "cfg.json").read_text())["metadata"]["hook_name"]
    latents = list(range(sae.cfg.d_sae)) if args.latents == "all" else args.latents
    config = SaeVisConfig(
        hook_point=hook,
        features=latents,
        minibatch_size_features=args.minibatch_features,
        minibatch_size_tokens=args.minibatch_tokens,
        feature_centric_layout=_layout(args),
        perform_ablation_experiments=False,
        device="cpu",
        dtype="float32",
        seed=0,
    )
    chosen = _Chosen()
    start = time.perf_counter()
    data = SaeVisRunner(config).run(encoder=sae, model=model, tokens=tokens)
    seconds = time.perf_counter() - start
    if args.bench:
        out = {"seconds": seconds, "latents": len(latents), "tokens": tokens.numel()}
        args.out.write_text(json.dumps(out))
        return
    stats = data.feature_stats
    position = {latent: i for i, latent in enumerate(latents)}
    features = {}
    for latent, groups in zip(latents, chosen.calls, strict=True):
        fd = data.feature_data_dict[latent]
        hist = fd.acts_histogram_data
        table = fd.logits_table_data
        features[str(latent)] = {
            "top": _entries(groups[0]),
            "top_displayed": _displayed(fd.sequence_data),
            # get_indices_dict makes them highest first: listed lowest first
            "intervals": [_entries(g) for g in reversed(groups[1:])],
            "max": stats.max[position[latent]],
            "density": stats.frac_nonzero[position[latent]],
            "histogram_counts": hist.bar_heights,
            "histogram_centres": hist.bar_values,
            "logits_top_token": table.top_token_ids,
            "logits_top_value": table.top_logits,
            "logits_bottom_token": table.bottom_token_ids,
            "logits_bottom_value": table.bottom_logits,
        }
    # How far TransformerLens's residual (the SAE's input) is from HF's on the same rows.
    seen = {}

    def keep(module, inputs, output) -> None:
        seen["x"] = output[0] if isinstance(output, tuple) else output

    handle = hf.transformer.h[1].register_forward_hook(keep)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:8], names_filter=[config.hook_point])
        hf(input_ids=tokens[:8])
    handle.remove()
    resid = (cache[config.hook_point] - seen["x"]).abs().max().item()
    out = {"seconds": seconds, "resid_max_diff": resid, "features": features}
    args.out.write_text(json.dumps(out))


def _latents(text: str) -> list[int] | str:
    return text if text == "all" else [int(t) for t in text.split(",")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("sae_dir", type=Path)
    parser.add_argument("tokens", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("latents", type=_latents)
    parser.add_argument("--minibatch-tokens", type=int, default=64)
    parser.add_argument("--minibatch-features", type=int, default=256)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--per-group", type=int, default=5)
    parser.add_argument("--logits", type=int, default=10)
    parser.add_argument("--bins", type=int, default=50)
    parser.add_argument("--bench", action="store_true")
    main(parser.parse_args())
