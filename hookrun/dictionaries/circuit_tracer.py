"""circuit-tracer's per-layer transcoders: `layer_<i>.safetensors`, one file a layer.

The format its `load_transcoder` reads and `SingleLayerTranscoder.to_safetensors` writes
(circuit_tracer/transcoder/single_layer_transcoder.py): W_enc [d_transcoder, d_model] (an
nn.Linear's layout: pre = x W_enc^T + b_enc), W_dec [d_transcoder, d_model], b_enc
[d_transcoder], b_dec [d_model], and optionally `activation_function.threshold`
[d_transcoder] (a JumpReLU: pre * (pre > threshold); without it a ReLU) and W_skip
[d_model, d_model] (x W_skip^T added to the output). No bias is subtracted from the input
and nothing is normalised. The folder's `config.yaml` (what `load_transcoder_set` is given)
names the hooks relative to a block: `feature_input_hook` (e.g. "hook_resid_mid",
"ln2.hook_normalized", "mlp.hook_in") and `feature_output_hook` (e.g. "hook_mlp_out"), so
layer i reads `blocks.{i}.{feature_input_hook}` and writes `blocks.{i}.{feature_output_hook}`
(as SAELens's circuit-tracer loader also spells them); without a config.yaml the hooks are
not known (None).

Stored as hookrun's Dictionary: W_enc and W_skip transposed to [d_in, d_sae] and
[d_in, d_out] (views), the threshold as `threshold`. circuit-tracer's JumpReLU has no ReLU
and its TopK keeps negative values, where SAELens's do not: a negative threshold and a
TopK transcoder are refused rather than computed another way than circuit-tracer does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hookrun.dictionaries.checks import check_tensors, read_tensors
from hookrun.dictionaries.dictionary import Dictionary
from hookrun.errors import HookrunError
from hookrun.models.weights import sha256_of

__all__ = ["CONFIG", "LAYER_FILE", "layer_files", "load_layer_file"]

CONFIG = "config.yaml"
LAYER_FILE = re.compile(r"layer_(\d+)\.safetensors")
THRESHOLD = "activation_function.threshold"


def layer_files(folder: Path) -> list[Path]:
    """The folder's layer_<i>.safetensors files, by layer.

    Args:
        folder: a circuit-tracer transcoder folder.

    Returns:
        The files, layer 0 first (layer_10 after layer_9); empty if none.
    """
    found = [(LAYER_FILE.fullmatch(p.name), p) for p in folder.iterdir() if p.is_file()]
    return [p for _, p in sorted((int(m.group(1)), p) for m, p in found if m)]


def _config(folder: Path, key: str) -> dict[str, Any]:
    file = folder / CONFIG
    if not file.is_file():
        return {}
    import yaml

    try:
        config = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        reason = str(err).splitlines()[0]
        raise HookrunError(
            f"{key}: {str(file)!r} is not readable YAML ({reason}); valid: circuit-tracer's "
            "config.yaml"
        ) from None
    config = config if isinstance(config, dict) else {}
    kind = config.get("model_kind", "transcoder_set")
    if kind != "transcoder_set":
        raise HookrunError(
            f"{key}: {str(file)!r}: model_kind {kind!r}; valid: transcoder_set (per-layer "
            "transcoders)"
        )
    activation = config.get("activation")
    if activation not in (None, "relu", "jumprelu"):
        raise HookrunError(
            f"{key}: {str(file)!r}: activation {activation!r}; valid: relu, jumprelu (or "
            "none: JumpReLU where the file has a threshold)"
        )
    return config


def load_layer_file(file: Path, key: str) -> Dictionary:
    """One circuit-tracer transcoder file, with the hooks its folder's config.yaml names.

    Args:
        file: a layer_<i>.safetensors (another name: the layer, and so the hooks, unknown).
        key: the config key that named it, for messages.

    Returns:
        The transcoder as a Dictionary (transcoder=True), tensors in the file's dtype.

    Raises:
        HookrunError: the file or its config.yaml is unreadable or not circuit-tracer's
            per-layer format, a tensor is missing, misshapen or not finite, or the
            activation is one whose math is not SAELens's (TopK, a negative threshold).
    """
    config = _config(file.parent, key)
    tensors = read_tensors(file, key)
    if "k" in tensors:
        raise HookrunError(
            f"{key}: {str(file)!r} is a TopK transcoder (tensor 'k'); valid: ReLU or JumpReLU "
            "transcoders (circuit-tracer's TopK keeps negative values, SAELens's does not)"
        )
    for vector in ("b_enc", "b_dec"):  # the sizes are read from them
        if vector not in tensors:
            check_tensors(tensors, {vector: ()}, file, key)  # refuses it as missing
        if tensors[vector].ndim != 1:
            raise HookrunError(
                f"{key}: {str(file)!r}'s tensor {vector!r} has shape "
                f"{list(tensors[vector].shape)}; valid: one axis"
            )
    d_sae, d_out = int(tensors["b_enc"].shape[0]), int(tensors["b_dec"].shape[0])
    w_enc = tensors.get("W_enc")
    d_in = int(w_enc.shape[-1]) if w_enc is not None and w_enc.ndim == 2 else d_out
    shapes: dict[str, tuple[int, ...]] = {
        "W_enc": (d_sae, d_in),
        "W_dec": (d_sae, d_out),
        "b_enc": (d_sae,),
        "b_dec": (d_out,),
    }
    jump = THRESHOLD in tensors or config.get("activation") == "jumprelu"
    if jump:
        shapes[THRESHOLD] = (d_sae,)
    if "W_skip" in tensors:
        shapes["W_skip"] = (d_out, d_in)
    check_tensors(tensors, shapes, file, key)
    kept = {
        "W_enc": tensors["W_enc"].T,
        "b_enc": tensors["b_enc"],
        "W_dec": tensors["W_dec"],
        "b_dec": tensors["b_dec"],
    }
    if jump:
        if (tensors[THRESHOLD] < 0).any():
            raise HookrunError(
                f"{key}: {str(file)!r}'s tensor {THRESHOLD!r} has negative values; valid: "
                "thresholds >= 0 (circuit-tracer's JumpReLU has no ReLU: below 0 it differs)"
            )
        kept["threshold"] = tensors[THRESHOLD]
    if "W_skip" in tensors:
        kept["W_skip"] = tensors["W_skip"].T
    match = LAYER_FILE.fullmatch(file.name)
    hook_in, hook_out = config.get("feature_input_hook"), config.get("feature_output_hook")
    known = match is not None and hook_in and hook_out
    return Dictionary(
        name=file.stem,
        architecture="jumprelu" if jump else "standard",
        d_in=d_in,
        d_sae=d_sae,
        d_out=d_out,
        transcoder=True,
        hook_name=f"blocks.{match.group(1)}.{hook_in}" if known else None,
        hook_name_out=f"blocks.{match.group(1)}.{hook_out}" if known else None,
        k=None,
        apply_b_dec_to_input=False,
        normalize="none",
        scaling_factor=None,
        tensors=kept,
        source=file,
        sha256=sha256_of(file),
    )
