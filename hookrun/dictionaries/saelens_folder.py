"""SAELens's on-disk format: a folder with `cfg.json` and `sae_weights.safetensors`.

What `SAE.save_model` writes in SAELens 6.54 (read without importing SAELens): cfg.json
holds `architecture`, `d_in`, `d_sae`, `d_out` (transcoders), `dtype`, `device`,
`apply_b_dec_to_input`, `normalize_activations`, `reshape_activations`, `k` and
`rescale_acts_by_decoder_norm` (topk) and `metadata` (`hook_name`, `hook_name_out`,
`model_name`, `sae_lens_version`, ...); configs from before 6.0 keep `hook_name` (or
`hook_point`) at the top and topk's k in `activation_fn_kwargs`, and SAELens reads them so
too. `sparsity.safetensors` beside them is not needed. SAELens's transcoders are
architectures of their own ("transcoder", "skip_transcoder", "jumprelu_transcoder",
"jumprelu_skip_transcoder"); a BatchTopK SAE is saved as "jumprelu".

expected_average_only_in's factor is not in cfg.json: SAELens's training folds it into the
weights when it ends (the saved cfg then says "none"), `SAE.from_pretrained` folds the
`norm_scaling_factor` of its pretrained-SAE directory, and `SAE.load_from_disk` applies
none. Only a training checkpoint keeps it on disk, in `activation_scaler.json`
(`{"scaling_factor": s}`), applied as SAELens's ActivationScaler does: x * s in, / s out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hookrun.dictionaries.checks import check_tensors, read_tensors
from hookrun.dictionaries.dictionary import NORMALIZE, Dictionary
from hookrun.errors import HookrunError
from hookrun.models.weights import sha256_of

__all__ = ["CFG", "WEIGHTS", "SAELENS_ARCHITECTURES", "is_saelens_folder", "load_saelens_folder"]

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
SCALER = "activation_scaler.json"
# SAELens's architecture name -> (hookrun's architecture, transcoder, skip connection).
SAELENS_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "standard": ("standard", False, False),
    "topk": ("topk", False, False),
    "jumprelu": ("jumprelu", False, False),
    "gated": ("gated", False, False),
    "transcoder": ("standard", True, False),
    "skip_transcoder": ("standard", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}


def _read_json(file: Path, key: str) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HookrunError(
            f"{key}: {str(file)!r} is not readable JSON ({err}); valid: SAELens's cfg.json"
        ) from None
    if not isinstance(value, dict):
        raise HookrunError(f"{key}: {str(file)!r} is not a JSON object; valid: SAELens's cfg.json")
    return value


def _int(cfg: dict[str, Any], name: str, file: Path, key: str) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HookrunError(f"{key}: {str(file)!r}: {name} is {value!r}; valid: a positive integer")
    return value


def _hook_names(cfg: dict[str, Any]) -> tuple[str | None, str | None]:
    """The hook names in metadata, else the top-level keys of configs before SAELens 6."""
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    hook = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    out = meta.get("hook_name_out") or cfg.get("hook_name_out") or cfg.get("hook_point_out")
    return hook, out


def _scaling_factor(folder: Path, key: str) -> float | None:
    file = folder / SCALER
    if not file.exists():
        return None
    value = _read_json(file, key).get("scaling_factor")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise HookrunError(
            f"{key}: {str(file)!r}: scaling_factor is {value!r}; valid: a number or null"
        )
    return None if value is None else float(value)


def load_saelens_folder(folder: Path, key: str) -> Dictionary:
    """The dictionary SAELens saved in `folder`.

    Args:
        folder: holds cfg.json and sae_weights.safetensors.
        key: the config key that named it, for messages.

    Returns:
        The Dictionary, tensors in the file's dtype.

    Raises:
        HookrunError: a file is missing or unreadable, the architecture or
            normalize_activations is not one hookrun computes, or a tensor is missing,
            misshapen or not finite.
    """
    cfg_file, weights = folder / CFG, folder / WEIGHTS
    for needed in (cfg_file, weights):
        if not needed.is_file():
            raise HookrunError(
                f"{key}: {str(folder)!r} has no {needed.name}; valid: a SAELens folder "
                f"({CFG} + {WEIGHTS}), a folder of them, or circuit-tracer's "
                "layer_<i>.safetensors"
            )
    cfg = _read_json(cfg_file, key)
    saelens_arch = cfg.get("architecture", "standard")
    if saelens_arch not in SAELENS_ARCHITECTURES:
        raise HookrunError(
            f"{key}: {str(cfg_file)!r}: architecture {saelens_arch!r}; valid: "
            f"{', '.join(SAELENS_ARCHITECTURES)}"
        )
    architecture, transcoder, skip = SAELENS_ARCHITECTURES[saelens_arch]
    normalize = cfg.get("normalize_activations", "none")
    if normalize not in NORMALIZE:
        raise HookrunError(
            f"{key}: {str(cfg_file)!r}: normalize_activations {normalize!r}; valid: "
            f"{', '.join(NORMALIZE)}"
        )
    d_in, d_sae = _int(cfg, "d_in", cfg_file, key), _int(cfg, "d_sae", cfg_file, key)
    d_out = _int(cfg, "d_out", cfg_file, key) if transcoder else d_in
    k = None
    if architecture == "topk":
        kwargs = cfg.get("activation_fn_kwargs") or {}
        k = _int({"k": cfg.get("k", kwargs.get("k"))}, "k", cfg_file, key)
        if k > d_sae:
            raise HookrunError(f"{key}: {str(cfg_file)!r}: k is {k}; valid: 1 to d_sae ({d_sae})")
    # SAELens's TranscoderConfig refuses b_dec subtracted (b_dec is in the output's space).
    apply_b_dec = bool(cfg.get("apply_b_dec_to_input", not transcoder))
    if transcoder and apply_b_dec:
        raise HookrunError(
            f"{key}: {str(cfg_file)!r}: apply_b_dec_to_input is true for a transcoder; valid: false"
        )
    tensors = read_tensors(weights, key)
    if architecture == "jumprelu" and "log_threshold" in tensors and "threshold" not in tensors:
        # Older checkpoints, converted as SAELens's process_state_dict_for_loading does.
        tensors["threshold"] = torch.exp(tensors.pop("log_threshold")).contiguous()
    check_tensors(tensors, _shapes(architecture, skip, d_in, d_sae, d_out), weights, key)
    kept = {n: t for n, t in tensors.items() if n in _shapes(architecture, skip, 1, 1, 1)}
    if skip:
        # SAELens keeps W_skip [d_out, d_in] and adds x @ W_skip.T: the transposed view
        # keeps that product's memory layout, so it rounds as SAELens's does.
        kept["W_skip"] = kept["W_skip"].T
    hook_name, hook_name_out = _hook_names(cfg)
    return Dictionary(
        name=folder.name,
        architecture=architecture,
        d_in=d_in,
        d_sae=d_sae,
        d_out=d_out,
        transcoder=transcoder,
        hook_name=hook_name,
        hook_name_out=hook_name_out if transcoder else None,
        k=k,
        apply_b_dec_to_input=apply_b_dec,
        normalize=normalize,
        scaling_factor=_scaling_factor(folder, key),
        tensors=kept,
        source=weights,
        sha256=sha256_of(weights),
        rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False))
        and architecture == "topk",
    )


def _shapes(
    architecture: str, skip: bool, d_in: int, d_sae: int, d_out: int
) -> dict[str, tuple[int, ...]]:
    """The tensors SAELens's class of `architecture` saves, in its layout."""
    shapes: dict[str, tuple[int, ...]] = {
        "W_enc": (d_in, d_sae),
        "W_dec": (d_sae, d_out),
        "b_dec": (d_out,),
    }
    if architecture == "gated":
        shapes |= {"b_gate": (d_sae,), "r_mag": (d_sae,), "b_mag": (d_sae,)}
    else:
        shapes["b_enc"] = (d_sae,)
    if architecture == "jumprelu":
        shapes["threshold"] = (d_sae,)
    if skip:
        shapes["W_skip"] = (d_out, d_in)
    return shapes


def is_saelens_folder(folder: Path) -> bool:
    """Whether `folder` holds a cfg.json (a SAELens folder, complete or not)."""
    return (folder / CFG).is_file()
