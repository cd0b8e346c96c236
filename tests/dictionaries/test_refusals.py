"""Every refusal of load_dictionaries, whole: one line naming the key, the bad value and
what is valid, raised before anything is computed. The folders are SAELens's format
written by hand (cfg.json as SAE.save_model writes it in 6.54)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hookrun.dictionaries import load_dictionaries
from hookrun.errors import HookrunError

KEY = "hooks.sae.args.path"
D_IN, D_SAE = 4, 6
VALID = (
    "valid: a SAELens folder (cfg.json + sae_weights.safetensors), a folder of SAELens "
    "folders, a circuit-tracer folder of layer_<i>.safetensors, or one .safetensors file"
)


def _sae(folder: Path, cfg: dict | None = None, **tensors: torch.Tensor) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        "d_in": D_IN,
        "d_sae": D_SAE,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {"sae_lens_version": "6.54.0", "hook_name": "blocks.0.hook_resid_pre"},
        "architecture": "standard",
    }
    (folder / "cfg.json").write_text(json.dumps(base | (cfg or {})))
    weights = {
        "W_enc": torch.ones(D_IN, D_SAE),
        "b_enc": torch.zeros(D_SAE),
        "W_dec": torch.ones(D_SAE, D_IN),
        "b_dec": torch.zeros(D_IN),
    }
    save_file(
        {k: v for k, v in (weights | tensors).items() if v is not None},
        folder / "sae_weights.safetensors",
    )
    return folder


def _refusal(path: Path | str) -> str:
    with pytest.raises(HookrunError) as err:
        load_dictionaries(path, key=KEY)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{KEY}: ")
    return message


def test_a_good_folder_loads(tmp_path: Path):
    (sae,) = load_dictionaries(_sae(tmp_path / "sae"), key=KEY)
    assert (sae.architecture, sae.d_in, sae.d_sae, sae.d_out) == ("standard", D_IN, D_SAE, D_IN)


def test_a_missing_path(tmp_path: Path):
    missing = tmp_path / "nope"
    assert _refusal(missing) == f"{KEY}: {str(missing)!r} does not exist; {VALID}"


def test_no_cfg_json_or_no_weights(tmp_path: Path):
    folder = _sae(tmp_path / "sae")
    (folder / "cfg.json").unlink()
    assert _refusal(folder) == (
        f"{KEY}: {str(folder)!r} has sae_weights.safetensors but no cfg.json; {VALID}"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _refusal(empty) == f"{KEY}: {str(empty)!r} holds no dictionary; {VALID}"
    folder = _sae(tmp_path / "sae2")
    (folder / "sae_weights.safetensors").unlink()
    assert _refusal(folder) == (
        f"{KEY}: {str(folder)!r} has no sae_weights.safetensors; valid: a SAELens folder "
        "(cfg.json + sae_weights.safetensors), a folder of them, or circuit-tracer's "
        "layer_<i>.safetensors"
    )
    other = tmp_path / "weights.pt"
    other.write_bytes(b"")
    assert _refusal(other) == f"{KEY}: {str(other)!r} is not a .safetensors file; {VALID}"


def test_an_unknown_architecture(tmp_path: Path):
    folder = _sae(tmp_path / "sae", {"architecture": "matryoshka_batchtopk"})
    assert _refusal(folder) == (
        f"{KEY}: {str(folder / 'cfg.json')!r}: architecture 'matryoshka_batchtopk'; valid: "
        "standard, topk, jumprelu, gated, transcoder, skip_transcoder, jumprelu_transcoder, "
        "jumprelu_skip_transcoder"
    )


def test_an_unknown_normalize_activations(tmp_path: Path):
    folder = _sae(tmp_path / "sae", {"normalize_activations": "layer_norm"})
    assert _refusal(folder) == (
        f"{KEY}: {str(folder / 'cfg.json')!r}: normalize_activations 'layer_norm'; valid: "
        "none, expected_average_only_in, constant_norm_rescale"
    )


def test_a_missing_tensor_named_with_its_file(tmp_path: Path):
    folder = _sae(tmp_path / "sae", {"architecture": "jumprelu"})
    file = folder / "sae_weights.safetensors"
    assert _refusal(folder) == (
        f"{KEY}: {str(file)!r} has no tensor 'threshold'; it has: W_dec, W_enc, b_dec, b_enc"
    )


def test_a_tensor_of_the_wrong_shape(tmp_path: Path):
    folder = _sae(tmp_path / "sae", W_dec=torch.ones(D_IN, D_SAE))
    file = folder / "sae_weights.safetensors"
    assert _refusal(folder) == (
        f"{KEY}: {str(file)!r}'s tensor 'W_dec' has shape [4, 6]; valid: [6, 4]"
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite(tmp_path: Path, bad: float):
    b_enc = torch.zeros(D_SAE)
    b_enc[2] = bad
    folder = _sae(tmp_path / "sae", b_enc=b_enc)
    file = folder / "sae_weights.safetensors"
    assert _refusal(folder) == (
        f"{KEY}: {str(file)!r}'s tensor 'b_enc' holds NaN or inf; valid: finite weights"
    )


def test_a_bad_topk_k_and_a_bad_size(tmp_path: Path):
    folder = _sae(tmp_path / "sae", {"architecture": "topk", "k": 0})
    assert _refusal(folder) == (
        f"{KEY}: {str(folder / 'cfg.json')!r}: k is 0; valid: a positive integer"
    )
    folder = _sae(tmp_path / "sae2", {"d_sae": "6"})
    assert _refusal(folder) == (
        f"{KEY}: {str(folder / 'cfg.json')!r}: d_sae is '6'; valid: a positive integer"
    )


def test_a_file_that_is_not_safetensors(tmp_path: Path):
    folder = _sae(tmp_path / "sae")
    (folder / "sae_weights.safetensors").write_bytes(b"not a safetensors file")
    message = _refusal(folder)
    assert message.startswith(f"{KEY}: {str(folder / 'sae_weights.safetensors')!r} is not a ")
    assert message.endswith("; valid: a file safetensors wrote")


def test_a_bad_folder_among_several_is_refused_by_name(tmp_path: Path):
    _sae(tmp_path / "a")
    _sae(tmp_path / "b", {"normalize_activations": "covariance_whitening"})
    message = _refusal(tmp_path)
    assert message.startswith(f"{KEY}: {str(tmp_path / 'b' / 'cfg.json')!r}: ")
    assert "normalize_activations 'covariance_whitening'; valid: none, " in message
