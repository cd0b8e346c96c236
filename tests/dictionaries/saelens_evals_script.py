"""Run by the SAELens venv's python (tests/reference_venvs.py), never imported by hookrun or
by a test: SAELens 6.54's own evals (`sae_lens.evals.run_evals`, every metric on) of one SAE
folder on fixed token rows, through a TransformerLens HookedTransformer built offline from
the tiny GPT-2's HF checkpoint (no hub access: the config is written by hand from its
config.json and the weights converted by TransformerLens's own `convert_gpt2_weights`).

Usage: python saelens_evals_script.py MODEL_DIR SAE_DIR TOKENS OUT_JSON BATCH [IGNORE]
TOKENS: a safetensors file with `tokens` (N, T) int64, evaluated in batches of BATCH rows
in order (N a multiple of BATCH). IGNORE: comma-separated token ids for run_evals'
`exclude_special_tokens` (absent: False, every token counts). OUT_JSON gets SAELens's
metrics flattened, dead/dense counts from its feature densities, and how far
TransformerLens's logits and block-1 residual are from HF's on the same tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sae_lens
import torch
from sae_lens.evals import get_eval_everything_config, run_evals
from sae_lens.training.activation_scaler import ActivationScaler
from safetensors.torch import load_file
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
from transformers import GPT2LMHeadModel

HOOK = "blocks.1.hook_resid_post"
DENSE = 0.1  # hookrun's sae_scores.dense default


def hooked_gpt2(
    model_dir: Path, cls: type = HookedTransformer
) -> tuple[HookedTransformer, GPT2LMHeadModel]:
    """The tiny GPT-2 as a TransformerLens `cls` (HookedSAETransformer for the splice
    script), its config written out from HF's, and HF's model."""
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
    model = cls(cfg)
    # Every weight processing off: folding LN and centring the writing weights change the
    # residual stream itself (blocks.1.hook_resid_post), which is what the SAE reads, so
    # TransformerLens's activations would no longer be HF's.
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf, cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return model.eval(), hf


class FixedTokens:
    """What run_evals asks of an ActivationsStore, over given rows: the same rows for the
    reconstruction batches and, after reset_input_dataset, for the sparsity ones."""

    def __init__(self, tokens: torch.Tensor, batch: int):
        self.tokens, self.store_batch_size_prompts = tokens, batch
        self.context_size = tokens.shape[1]
        self.at = 0

    def get_batch_tokens(self, n: int) -> torch.Tensor:
        rows = self.tokens[self.at : self.at + n]
        assert len(rows) == n, "ran past the given rows"
        self.at += n
        return rows

    def reset_input_dataset(self) -> None:
        self.at = 0


def main(model_dir: Path, sae_dir: Path, tokens_file: Path, out: Path, batch: int, ignore):
    tokens = load_file(str(tokens_file))["tokens"].long()
    model, hf = hooked_gpt2(model_dir)
    seen = {}

    # transformer.h.1's output (what hookrun splices at): HF's last hidden_states entry has
    # ln_f applied already, blocks.1.hook_resid_post does not.
    def keep(module, args, output) -> None:
        seen["x"] = output[0] if isinstance(output, tuple) else output

    handle = hf.transformer.h[1].register_forward_hook(keep)
    with torch.no_grad():
        tl_logits, cache = model.run_with_cache(tokens, names_filter=[HOOK])
        hf_logits = hf(input_ids=tokens).logits
    handle.remove()
    checks = {
        "logits_max_diff": (tl_logits - hf_logits).abs().max().item(),
        "resid_max_diff": (cache[HOOK] - seen["x"]).abs().max().item(),
    }
    sae = sae_lens.SAE.load_from_disk(str(sae_dir)).eval()
    assert sae.cfg.metadata.hook_name == HOOK
    batches = len(tokens) // batch
    assert batches * batch == len(tokens)
    config = get_eval_everything_config(
        batch_size_prompts=batch,
        n_eval_reconstruction_batches=batches,
        n_eval_sparsity_variance_batches=batches,
    )
    metrics, features = run_evals(
        sae,
        FixedTokens(tokens, batch),
        model,
        ActivationScaler(),
        config,
        exclude_special_tokens=ignore if ignore else False,
    )
    flat = {name: value for group in metrics.values() for name, value in group.items()}
    density = torch.tensor(features["feature_density"], dtype=torch.float64)
    flat["dead"] = int((density == 0).sum())
    flat["dense"] = int((density > DENSE).sum())
    flat["saelens"] = sae_lens.__version__
    out.write_text(json.dumps(flat | checks, indent=1))


if __name__ == "__main__":
    ignored = [int(t) for t in sys.argv[6].split(",")] if len(sys.argv) > 6 else None
    main(*map(Path, sys.argv[1:5]), int(sys.argv[5]), ignored)
