"""Run by the SAELens venv's python (tests/reference_venvs.py), never imported by hookrun or
by a test: SAELens 6.54's own splice of its own SAEs into a TransformerLens model of the tiny
GPT-2 (built offline as saelens_evals_script.py builds it), for test_splice_vs_saelens.py.

    python saelens_splice_script.py build MODEL_DIR OUT_DIR
        SAELens builds each case's SAE (CASES) with random weights, its biases or thresholds
        set from the model's activations on the first heldout documents so that about a
        quarter of the latents fire, and saves it with its own save_model to OUT_DIR/<case>/.
        OUT_DIR/edits.json: per case, the two latents of the largest mean (the edit zeroes).
    python saelens_splice_script.py splice MODEL_DIR OUT_DIR TOKENS
        On the rows of TOKENS (a safetensors file with `tokens`, (N, T) int64), per case
        and mode, through HookedSAETransformer.run_with_cache_with_saes: the logits (N, T,
        vocab) and the latents (hook_sae_acts_post), to OUT_DIR/<case>.<mode>.safetensors.
        Modes: error (use_error_term=True), recon (False), error_edit / recon_edit (the
        two latents of edits.json zeroed by a hook on hook_sae_acts_post).

A skip transcoder: SAELens's wrapper (_SAEWrapper.forward) calls sae.decode, which has no
skip term (SkipTranscoder adds x @ W_skip.T in forward only). With the error term that
cancels (the error is taken against the same decode), so the wrapper's numbers are the
transcoder's; without it the wrapper drops the skip path. For the recon modes of a skip
transcoder the script therefore also splices SAELens's own forward by plain TransformerLens
hooks (mode recon_forward, recon_edit_forward: the latents edited inside forward's encode by
the same hook), and saves the wrapper's numbers as recon / recon_edit beside them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sae_lens
import torch
from sae_lens import HookedSAETransformer
from sae_lens.saes.sae import SAEMetadata
from saelens_evals_script import hooked_gpt2 as evals_model  # this folder: on sys.path
from safetensors.torch import save_file
from transformers import AutoTokenizer

D_MODEL, D_SAE, D_MLP_OUT = 128, 256, 128
RESID = "blocks.1.hook_resid_post"
MLP_IN, MLP_OUT = "blocks.0.ln2.hook_normalized", "blocks.0.hook_mlp_out"
FIRE = 0.25  # the share of (token, latent) pairs meant to fire
CASES = {
    "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}),
    "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 32}),
    "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig, {}),
    "gated": (sae_lens.GatedSAE, sae_lens.GatedSAEConfig, {}),
    "transcoder": (sae_lens.Transcoder, sae_lens.TranscoderConfig, {"d_out": D_MLP_OUT}),
    "skip_transcoder": (
        sae_lens.SkipTranscoder,
        sae_lens.SkipTranscoderConfig,
        {"d_out": D_MLP_OUT},
    ),
}


def hooked_gpt2(model_dir: Path) -> HookedSAETransformer:
    """The tiny GPT-2 as a HookedSAETransformer: saelens_evals_script.py's model."""
    return evals_model(model_dir, HookedSAETransformer)[0]


def calibration(model_dir: Path, model: HookedSAETransformer) -> dict[str, torch.Tensor]:
    """The sites' activations on the first heldout documents (the rows hookrun's runs read
    come from the same corpus: the latents fire there about as often)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lines = (model_dir / "heldout.jsonl").read_text().splitlines()[:20]
    ids = [i for line in lines for i in tokenizer(json.loads(line)["text"])["input_ids"]]
    rows = torch.tensor(ids[: 8 * 64]).reshape(8, 64)
    with torch.no_grad():
        _, cache = model.run_with_cache(rows, names_filter=[RESID, MLP_IN])
    return {name: cache[name].reshape(-1, D_MODEL) for name in (RESID, MLP_IN)}


def build(case: str, seed: int, acts: dict[str, torch.Tensor]):
    cls, cfg_cls, extra = CASES[case]
    transcoder = "transcoder" in case
    meta = {"hook_name": MLP_IN, "hook_name_out": MLP_OUT} if transcoder else {"hook_name": RESID}
    cfg = cfg_cls(
        d_in=D_MODEL,
        d_sae=D_SAE,
        apply_b_dec_to_input=not transcoder,
        normalize_activations="none",
        metadata=SAEMetadata(**meta),
        **extra,
    )
    sae = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    x = acts[MLP_IN if transcoder else RESID]
    with torch.no_grad():
        for name, p in sae.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.startswith("W_"):
                p.copy_(noise / p.shape[0] ** 0.5)
            elif name == "r_mag":
                p.copy_(noise * 0.2)
            else:
                p.copy_(noise * 0.1)
        # Each latent's encoder bias (or threshold) at the quantile of its pre-activation
        # that lets FIRE of the calibration tokens through.
        centred = x - sae.b_dec if cfg.apply_b_dec_to_input else x
        pre = centred @ sae.W_enc
        cut = torch.quantile(pre, 1 - FIRE, dim=0)
        if case == "gated":
            sae.b_gate.copy_(-cut)
        elif case == "jumprelu":
            # pre + b_enc passes where it exceeds the threshold: a positive threshold
            # (the jump) at the same cut
            sae.threshold.copy_(torch.rand(D_SAE, generator=gen) * 0.5 + 0.1)
            sae.b_enc.copy_(sae.threshold - cut)
        elif case != "topk":  # topk keeps its k largest, whatever the bias
            sae.b_enc.copy_(-cut)
    return sae.eval()


def do_build(model_dir: Path, out: Path) -> None:
    model = hooked_gpt2(model_dir)
    acts = calibration(model_dir, model)
    edits = {}
    for seed, case in enumerate(sorted(CASES)):
        sae = build(case, seed, acts)
        sae.save_model(out / case)
        with torch.no_grad():
            z = sae.encode(acts[sae.cfg.metadata.hook_name])
        edits[case] = sorted(z.mean(0).topk(2).indices.tolist())
    (out / "edits.json").write_text(json.dumps(edits))
    print("saelens", sae_lens.__version__)


def zero(latents: list[int]):
    def hook(acts: torch.Tensor, hook) -> torch.Tensor:  # noqa: ARG001
        acts = acts.clone()
        acts[..., latents] = 0.0
        return acts

    return hook


def wrapped(model, sae, tokens, error_term: bool, edit: list[int] | None):
    """SAELens's documented splice: run_with_cache_with_saes, the edit a hook on the
    attached SAE's hook_sae_acts_post."""
    site = sae.cfg.metadata.hook_name_out or sae.cfg.metadata.hook_name
    acts = f"{site}.hook_sae_acts_post"
    hooks = [(acts, zero(edit))] if edit else []
    model.add_sae(sae, use_error_term=error_term)
    try:
        assert acts in model.hook_dict, sorted(model.hook_dict)[-10:]
        with model.hooks(fwd_hooks=hooks):
            # with an edit the cached latents are the edited ones (the edit's hook runs
            # first); the test compares hookrun's (the unedited) with an unedited mode's
            logits, cache = model.run_with_cache(tokens, names_filter=[acts])
    finally:
        model.reset_saes()
    return logits, cache[acts]


def forwarded(model, sae, tokens, edit: list[int] | None):
    """A transcoder's own forward (skip term included) in place of the MLP's output, by
    plain TransformerLens hooks: no error term."""
    seen = {}

    def keep(x, hook) -> torch.Tensor:  # noqa: ARG001
        seen["in"] = x
        return x

    def replace(out, hook) -> torch.Tensor:  # noqa: ARG001
        return sae(seen["in"])

    sae_hooks = [(sae.hook_sae_acts_post, zero(edit))] if edit else []
    for point, fn in sae_hooks:
        point.add_hook(fn)
    try:
        logits = model.run_with_hooks(tokens, fwd_hooks=[(MLP_IN, keep), (MLP_OUT, replace)])
    finally:
        for point, _ in sae_hooks:
            point.remove_hooks()
    return logits


def do_splice(model_dir: Path, out: Path, tokens_file: Path) -> None:
    from safetensors.torch import load_file

    tokens = load_file(str(tokens_file))["tokens"].long()
    model = hooked_gpt2(model_dir)
    edits = json.loads((out / "edits.json").read_text())
    with torch.no_grad():
        plain = model(tokens)
        save_file({"logits": plain.contiguous()}, str(out / "plain.safetensors"))
        for case in sorted(CASES):
            sae = sae_lens.SAE.load_from_disk(str(out / case)).eval()
            for mode in ("error", "recon", "error_edit", "recon_edit"):
                edit = edits[case] if mode.endswith("edit") else None
                logits, acts = wrapped(model, sae, tokens, mode.startswith("error"), edit)
                found = {"logits": logits.contiguous(), "latents": acts.contiguous()}
                save_file(found, str(out / f"{case}.{mode}.safetensors"))
                if "skip" in case and mode.startswith("recon"):
                    logits = forwarded(model, sae, tokens, edit)
                    save_file(
                        {"logits": logits.contiguous()},
                        str(out / f"{case}.{mode}_forward.safetensors"),
                    )
    print("saelens", sae_lens.__version__)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "build":
        do_build(Path(rest[0]), Path(rest[1]))
    else:
        do_splice(Path(rest[0]), Path(rest[1]), Path(rest[2]))
