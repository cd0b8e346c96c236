"""circuit-tracer's per-layer transcoders, written by hand in the format its loader reads.

The format is circuit-tracer's (decoderesearch/circuit-tracer,
circuit_tracer/transcoder/single_layer_transcoder.py: `SingleLayerTranscoder.to_safetensors`
writes and `load_transcoder` reads `layer_<i>.safetensors` with W_enc [d_transcoder,
d_model], W_dec [d_transcoder, d_model], b_enc, b_dec, optional
`activation_function.threshold` and W_skip [d_model, d_model]; `load_transcoder_set` takes
the folder's config.yaml's feature_input_hook / feature_output_hook, read per layer as
`blocks.{i}.{hook}`). Its math, written out below from its encode/decode:
pre = x W_enc^T + b_enc; acts = relu(pre), or pre * (pre > threshold) with a threshold;
out = acts W_dec + b_dec + x W_skip^T.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hookrun.dictionaries import load_dictionaries
from hookrun.errors import HookrunError

D_MODEL, D_TC = 8, 20


def _layer(seed: int, threshold: bool, skip: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "W_enc": torch.randn(D_TC, D_MODEL, generator=gen) / D_MODEL**0.5,
        "W_dec": torch.randn(D_TC, D_MODEL, generator=gen) / D_TC**0.5,
        "b_enc": torch.randn(D_TC, generator=gen) * 0.3,
        "b_dec": torch.randn(D_MODEL, generator=gen) * 0.3,
    }
    if threshold:
        tensors["activation_function.threshold"] = torch.rand(D_TC, generator=gen) * 0.5
    if skip:
        tensors["W_skip"] = torch.randn(D_MODEL, D_MODEL, generator=gen) * 0.1
    return tensors


def _formula(t: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pre = torch.nn.functional.linear(x, t["W_enc"], t["b_enc"])
    if "activation_function.threshold" in t:
        acts = pre * (pre > t["activation_function.threshold"])
    else:
        acts = torch.relu(pre)
    out = acts @ t["W_dec"] + t["b_dec"]
    if "W_skip" in t:
        out = out + x @ t["W_skip"].T
    return acts, out


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Twelve layers (layer_10 must come after layer_9), JumpReLU with a skip connection
    on the even ones, ReLU on the odd, and the config.yaml circuit-tracer reads."""
    for i in range(12):
        save_file(
            _layer(i, threshold=i % 2 == 0, skip=i % 2 == 0), tmp_path / f"layer_{i}.safetensors"
        )
    (tmp_path / "config.yaml").write_text(
        "model_kind: transcoder_set\nfeature_input_hook: ln2.hook_normalized\n"
        "feature_output_hook: hook_mlp_out\n"
    )
    return tmp_path


def test_every_layer_loads_in_order_with_its_hooks(folder: Path):
    found = load_dictionaries(folder, key="hooks.tc.args.path")
    assert [d.name for d in found] == [f"layer_{i}" for i in range(12)]
    assert found[3].hook_name == "blocks.3.ln2.hook_normalized"
    assert found[10].hook_name_out == "blocks.10.hook_mlp_out"
    assert all(d.transcoder and not d.apply_b_dec_to_input for d in found)
    assert [d.architecture for d in found[:2]] == ["jumprelu", "standard"]
    assert found[0].tensors["W_enc"].shape == (D_MODEL, D_TC)  # [d_in, d_sae]
    assert found[0].tensors["W_skip"].shape == (D_MODEL, D_MODEL)


@pytest.mark.parametrize("layer", [0, 1])  # JumpReLU + skip, ReLU
def test_encode_decode_equal_circuit_tracers_formula(folder: Path, layer: int):
    (tc,) = load_dictionaries(folder / f"layer_{layer}.safetensors", key="k")
    t = _layer(layer, threshold=layer == 0, skip=layer == 0)
    x = torch.randn(4, 6, D_MODEL, generator=torch.Generator().manual_seed(9)) * 2
    acts, out = _formula(t, x)
    assert (acts > 0).any() and (acts == 0).any()
    z = tc.encode(x)
    torch.testing.assert_close(z, acts, atol=1e-6, rtol=0)
    torch.testing.assert_close(tc.decode(z, x), out, atol=1e-6, rtol=0)
    assert tc.hook_name == f"blocks.{layer}.ln2.hook_normalized"


def test_without_config_yaml_the_hooks_are_unknown(tmp_path: Path):
    save_file(_layer(0, threshold=False, skip=False), tmp_path / "layer_2.safetensors")
    (tc,) = load_dictionaries(tmp_path, key="k")
    assert (tc.name, tc.hook_name, tc.hook_name_out) == ("layer_2", None, None)


def test_a_skip_transcoder_needs_the_input_to_decode(folder: Path):
    (tc,) = load_dictionaries(folder / "layer_0.safetensors", key="k")
    with pytest.raises(ValueError, match="input x"):
        tc.decode(torch.zeros(D_TC))


def test_topk_and_negative_thresholds_are_refused(tmp_path: Path):
    t = _layer(0, threshold=True, skip=False)
    save_file(t | {"k": torch.tensor(4)}, tmp_path / "layer_0.safetensors")
    with pytest.raises(HookrunError, match=r"^key: .*layer_0.safetensors' is a TopK transcoder"):
        load_dictionaries(tmp_path, key="key")
    t["activation_function.threshold"][2] = -0.1
    save_file(t, tmp_path / "layer_0.safetensors")
    with pytest.raises(HookrunError, match="negative values; valid: thresholds >= 0"):
        load_dictionaries(tmp_path, key="key")


def test_a_cross_layer_transcoder_is_refused(folder: Path):
    (folder / "config.yaml").write_text("model_kind: cross_layer_transcoder\n")
    with pytest.raises(
        HookrunError, match="model_kind 'cross_layer_transcoder'; valid: transcoder_set"
    ):
        load_dictionaries(folder, key="key")
