"""Run by the SAELens venv's python (tests/reference_venvs.py), never imported by hookrun or
by a test: SAELens 6.54 builds each case's SAE with random weights, saves it with its own
`save_model`, and encodes and decodes fixed activations; the results go beside it.

Usage: python saelens_script.py OUT_DIR CASES_JSON. CASES_JSON maps a case name to its
settings: architecture (SAELens's name), apply_b_dec_to_input, normalize_activations, and
optionally k, rescale_acts_by_decoder_norm, scaling_factor (written as a training
checkpoint's activation_scaler.json and applied as SAELens's ActivationScaler does).
For each case it writes OUT_DIR/<case>/ (the SAE folder) and OUT_DIR/<case>.results.safetensors
(x, z = encode, out = the output SAELens computes: decode, forward for a skip transcoder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import sae_lens
import torch
from sae_lens.saes.sae import SAEMetadata
from sae_lens.training.activation_scaler import ActivationScaler
from safetensors.torch import save_file

D_IN, D_SAE, D_OUT = 16, 48, 12
CLASSES = {
    "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
    "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
    "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
    "gated": (sae_lens.GatedSAE, sae_lens.GatedSAEConfig),
    "transcoder": (sae_lens.Transcoder, sae_lens.TranscoderConfig),
    "skip_transcoder": (sae_lens.SkipTranscoder, sae_lens.SkipTranscoderConfig),
    "jumprelu_transcoder": (sae_lens.JumpReLUTranscoder, sae_lens.JumpReLUTranscoderConfig),
    "jumprelu_skip_transcoder": (
        sae_lens.JumpReLUSkipTranscoder,
        sae_lens.JumpReLUSkipTranscoderConfig,
    ),
}


def build(settings: dict, seed: int):
    cls, cfg_cls = CLASSES[settings["architecture"]]
    transcoder = "transcoder" in settings["architecture"]
    meta = {"hook_name": "blocks.1.hook_resid_pre", "model_name": "tiny"}
    kwargs = {"d_in": D_IN, "d_sae": D_SAE}
    if transcoder:
        meta = {
            "hook_name": "blocks.1.ln2.hook_normalized",
            "hook_name_out": "blocks.1.hook_mlp_out",
        }
        kwargs["d_out"] = D_OUT
    for name in ("k", "rescale_acts_by_decoder_norm"):
        if name in settings:
            kwargs[name] = settings[name]
    cfg = cfg_cls(
        **kwargs,
        apply_b_dec_to_input=settings["apply_b_dec_to_input"],
        normalize_activations=settings["normalize_activations"],
        metadata=SAEMetadata(**meta),
    )
    sae = cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name == "threshold":  # positive, so some latents pass and some do not
                p.copy_(torch.rand(p.shape, generator=gen) * 0.8)
            elif name == "r_mag":
                p.copy_(noise * 0.2)
            elif name.startswith("W_"):
                p.copy_(noise / p.shape[0] ** 0.5)
            else:  # the biases: nothing trivially zero
                p.copy_(noise * 0.5)
    return sae.eval()


def batchtopk(settings: dict, seed: int, folder: Path):
    """A BatchTopK training SAE saved as SAELens saves one when training ends (as
    jumprelu, its batch threshold the threshold of every latent), then loaded back by
    SAELens's own load_from_disk: that SAE is the reference."""
    cfg = sae_lens.BatchTopKTrainingSAEConfig(
        d_in=D_IN,
        d_sae=D_SAE,
        k=5.0,
        apply_b_dec_to_input=settings["apply_b_dec_to_input"],
        normalize_activations=settings["normalize_activations"],
    )
    training = sae_lens.BatchTopKTrainingSAE(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in training.named_parameters():
            scale = 1 / p.shape[0] ** 0.5 if name.startswith("W_") else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    training.topk_threshold = torch.tensor(0.4, dtype=torch.double)
    training.save_inference_model(folder)
    return sae_lens.SAE.load_from_disk(folder).eval()


def main(out: Path, cases: dict) -> None:
    for seed, (case, settings) in enumerate(sorted(cases.items())):
        if settings["architecture"] == "batchtopk":
            sae = batchtopk(settings, seed, out / case)
            assert json.loads((out / case / "cfg.json").read_text())["architecture"] == "jumprelu"
        else:
            sae = build(settings, seed)
            sae.save_model(out / case)
        scaler = ActivationScaler(scaling_factor=settings.get("scaling_factor"))
        if scaler.scaling_factor is not None:
            scaler.save(str(out / case / "activation_scaler.json"))
        gen = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn(3, 5, D_IN, generator=gen) * 2.0 + 0.3
        with torch.no_grad():
            z = sae.encode(scaler.scale(x))
            if "skip" in settings["architecture"]:
                # SkipTranscoder adds x @ W_skip.T in forward, not in decode.
                recon = sae.decode(z) + x @ sae.W_skip.T
                assert torch.equal(recon, sae.forward(x))
            else:
                recon = sae.decode(z)
            recon = scaler.unscale(recon)
        save_file(
            {"x": x, "z": z.contiguous(), "out": recon.contiguous()},
            str(out / f"{case}.results.safetensors"),
        )
    print("saelens", sae_lens.__version__, "torch", torch.__version__, torch.__file__)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
