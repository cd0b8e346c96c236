"""SAE folders written by hand in SAELens's on-disk format (cfg.json + sae_weights.safetensors,
as `SAE.save_model` writes them; tests/dictionaries/test_against_saelens.py checks hookrun
reads SAELens's own), with seeded random weights, and the formulas of a standard SAE and
transcoder written out: what the splice tests compare a run with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_sae(
    folder: Path,
    d_in: int,
    d_sae: int,
    seed: int = 0,
    hook_name: str | None = None,
    transcoder: bool = False,
    d_out: int | None = None,
    hook_name_out: str | None = None,
) -> dict[str, torch.Tensor]:
    """A standard SAE (or transcoder) in `folder`; its tensors. The encoder's bias is set so
    that about a third of the latents fire on activations of unit scale."""
    generator = torch.Generator().manual_seed(seed)
    d_out = d_out or d_in
    tensors = {
        "W_enc": torch.randn(d_in, d_sae, generator=generator) / d_in**0.5,
        "b_enc": torch.randn(d_sae, generator=generator) * 0.3 - 0.4,
        "W_dec": torch.randn(d_sae, d_out, generator=generator) / d_sae**0.5,
        "b_dec": torch.randn(d_out, generator=generator) * 0.1,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    cfg = {
        "architecture": "transcoder" if transcoder else "standard",
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": not transcoder,
        "normalize_activations": "none",
        "metadata": {"hook_name": hook_name, "sae_lens_version": "6.54.0"},
    }
    if transcoder:
        cfg["d_out"] = d_out
        cfg["metadata"]["hook_name_out"] = hook_name_out
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return tensors


def encode(t: dict[str, torch.Tensor], x: torch.Tensor, transcoder: bool = False) -> torch.Tensor:
    """SAELens's standard encode: ReLU((x − b_dec) W_enc + b_enc) (no b_dec for transcoders)."""
    x = x if transcoder else x - t["b_dec"]
    return torch.relu(x @ t["W_enc"] + t["b_enc"])


def decode(t: dict[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """z W_dec + b_dec."""
    return z @ t["W_dec"] + t["b_dec"]
