"""hookrun's dictionaries against SAELens 6.54 itself: SAELens builds, saves (its own
save_model) and runs an SAE of every architecture it has an inference class for, and
hookrun's load_dictionaries + encode/decode must give its numbers from its files.

SAELens runs in a venv of its own (tests/reference_venvs.py: its pins clash with hookrun's)
in a subprocess; nothing of it is imported here. float32 throughout; the tolerance asserted
is atol 1e-6 with rtol 0 (hookrun repeats SAELens's operations in SAELens's order, so the
differences measured are 0 or a few float32 ulps).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hookrun.dictionaries import load_dictionaries

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_venvs import saelens_python  # noqa: E402

SCRIPT = Path(__file__).with_name("saelens_script.py")
ATOL = 1e-6


def _case(architecture: str, b_dec: bool = True, normalize: str = "none", **extra) -> dict:
    return {
        "architecture": architecture,
        "apply_b_dec_to_input": b_dec,
        "normalize_activations": normalize,
        **extra,
    }


CASES = {
    "standard": _case("standard"),
    "standard_no_b_dec": _case("standard", b_dec=False),
    "standard_expected_average": _case("standard", normalize="expected_average_only_in"),
    "standard_expected_average_scaler": _case(
        "standard", normalize="expected_average_only_in", scaling_factor=0.37
    ),
    "standard_constant_norm": _case("standard", normalize="constant_norm_rescale"),
    "standard_constant_norm_no_b_dec": _case(
        "standard", b_dec=False, normalize="constant_norm_rescale"
    ),
    "topk": _case("topk", k=5),
    "topk_no_b_dec": _case("topk", b_dec=False, k=7),
    "topk_rescaled": _case("topk", k=5, rescale_acts_by_decoder_norm=True),
    "topk_constant_norm": _case("topk", k=5, normalize="constant_norm_rescale"),
    "jumprelu": _case("jumprelu"),
    "jumprelu_no_b_dec": _case("jumprelu", b_dec=False),
    "jumprelu_scaler": _case("jumprelu", normalize="expected_average_only_in", scaling_factor=2.5),
    # saved as jumprelu by SAELens's training (save_inference_model), read back by its
    # load_from_disk for the reference numbers
    "batchtopk": _case("batchtopk"),
    "gated": _case("gated"),
    "gated_no_b_dec": _case("gated", b_dec=False),
    "gated_constant_norm": _case("gated", normalize="constant_norm_rescale"),
    "transcoder": _case("transcoder", b_dec=False),
    "transcoder_constant_norm": _case("transcoder", b_dec=False, normalize="constant_norm_rescale"),
    "skip_transcoder": _case("skip_transcoder", b_dec=False),
    "jumprelu_transcoder": _case("jumprelu_transcoder", b_dec=False),
    "jumprelu_skip_transcoder": _case("jumprelu_skip_transcoder", b_dec=False),
}


# SAELens's architecture -> hookrun's (a transcoder is its activation plus transcoder=True)
HOOKRUNS = {
    "batchtopk": "jumprelu",
    "transcoder": "standard",
    "skip_transcoder": "standard",
    "jumprelu_transcoder": "jumprelu",
    "jumprelu_skip_transcoder": "jumprelu",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Every case's SAE folder and SAELens's results, made once by SAELens."""
    out = tmp_path_factory.mktemp("saelens")
    cases = out / "cases.json"
    cases.write_text(json.dumps(CASES))
    done = subprocess.run(
        [str(saelens_python()), str(SCRIPT), str(out), str(cases)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "saelens 6.54.0" in done.stdout
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_encode_and_decode_equal_saelens(saved: Path, case: str):
    (sae,) = load_dictionaries(saved / case, key="hooks.sae.args.path")
    ref = load_file(str(saved / f"{case}.results.safetensors"))
    x, z_ref, out_ref = ref["x"], ref["z"], ref["out"]
    assert (z_ref != 0).any() and (z_ref == 0).any()  # some latents on, some off
    z = sae.encode(x)
    assert z.dtype == torch.float32 and z.shape == z_ref.shape
    torch.testing.assert_close(z, z_ref, atol=ATOL, rtol=0)
    # decode from SAELens's own latents, and the whole round trip from hookrun's
    torch.testing.assert_close(sae.decode(z_ref, x), out_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(sae.decode(z, x), out_ref, atol=ATOL, rtol=0)
    settings = CASES[case]
    assert sae.transcoder == ("transcoder" in settings["architecture"])
    assert sae.d_out == (12 if sae.transcoder else 16)
    assert sae.normalize == settings["normalize_activations"]
    assert sae.scaling_factor == settings.get("scaling_factor")
    assert sae.k == settings.get("k")
    assert sae.architecture == HOOKRUNS.get(settings["architecture"], settings["architecture"])
    assert ("W_skip" in sae.tensors) == ("skip" in settings["architecture"])


def test_metadata_and_provenance(saved: Path):
    (sae,) = load_dictionaries(saved / "standard", key="k")
    assert sae.hook_name == "blocks.1.hook_resid_pre" and sae.hook_name_out is None
    assert sae.name == "standard" and sae.source == saved / "standard" / "sae_weights.safetensors"
    import hashlib

    assert sae.sha256 == hashlib.sha256(sae.source.read_bytes()).hexdigest()
    (tc,) = load_dictionaries(saved / "skip_transcoder", key="k")
    assert (tc.hook_name, tc.hook_name_out) == (
        "blocks.1.ln2.hook_normalized",
        "blocks.1.hook_mlp_out",
    )
    assert tc.tensors["W_skip"].shape == (16, 12)  # [d_in, d_out]
    # the weights file itself, named directly, loads the same SAE
    (again,) = load_dictionaries(saved / "gated" / "sae_weights.safetensors", key="k")
    assert again.architecture == "gated" and again.name == "gated"


def test_a_folder_of_folders_loads_every_sae_sorted(saved: Path, tmp_path: Path):
    for case in ("topk", "gated", "jumprelu"):
        (tmp_path / case).symlink_to(saved / case)
    found = load_dictionaries(tmp_path, key="k")
    assert [d.name for d in found] == ["gated", "jumprelu", "topk"]
    assert [d.architecture for d in found] == ["gated", "jumprelu", "topk"]


def test_encode_is_differentiable_and_to_converts(saved: Path):
    (sae,) = load_dictionaries(saved / "jumprelu", key="k")
    ref = load_file(str(saved / "jumprelu.results.safetensors"))
    x = ref["x"].clone().requires_grad_(True)
    sae.decode(sae.encode(x), x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    low = sae.to("cpu", torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in low.tensors.values())
    assert sae.tensors["W_enc"].dtype == torch.float32  # the original is unchanged
    assert low.encode(ref["x"]).dtype == torch.bfloat16


def test_decoder_direction_is_what_decoding_one_unit_adds(saved: Path):
    for case in ("standard", "standard_expected_average_scaler", "topk_rescaled"):
        (sae,) = load_dictionaries(saved / case, key="k")
        one = torch.zeros(sae.d_sae)
        one[3] = 1.0
        added = sae.decode(one) - sae.decode(torch.zeros(sae.d_sae))
        torch.testing.assert_close(sae.decoder_direction(3), added, atol=ATOL, rtol=0)
