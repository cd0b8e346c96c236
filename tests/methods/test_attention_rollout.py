"""experiment=attention_rollout (Abnar & Zuidema 2020) against references computed here:
the arithmetic on a 2-layer case worked by hand; a GPT-2 built from a small config against
numpy's rollout of the model's own `output_attentions=True` probabilities (each prompt alone,
unpadded); a small torchvision ViT against numpy's rollout of probabilities recomputed here
from each block's LayerNorm'd input and its in_proj weights (themselves checked against
`nn.MultiheadAttention(need_weights=True, average_attn_weights=False)` called directly);
head fusion, discard and start layer variants; the models' parameters, forward, hooks and
attention implementation unchanged by a run; and every refusal, in one line before any work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torchvision
import transformers
from conftest import run_config
from torch import nn

import hookrun
from hookrun.errors import HookrunError
from hookrun.stages.derive.rollout_math import (
    discard_lowest,
    fuse_heads,
    rollout_rows,
    with_residual,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lm"))
from lm_models import FAMILIES, prompt_run, save_lm, tokenizer, write_jsonl  # noqa: E402

KEY = "derive.attention_rollout"
PROMPTS = [
    {"prompt": "The cat sat on the"},
    {"prompt": "A quick brown fox jumps over"},
    {"prompt": "Hooks"},
]
# (head_fusion, discard_ratio, start_layer): the default, and each option moved.
VARIANTS = [("mean", 0.0, 0), ("max", 0.3, 0), ("min", 0.0, 1), ("mean", 0.5, 1)]


def _options(fusion: str = "mean", discard: float = 0.0, start: int = 0) -> list[str]:
    return [
        f"{KEY}.head_fusion={fusion}",
        f"{KEY}.discard_ratio={discard}",
        f"{KEY}.start_layer={start}",
    ]


# --- numpy reference: the paper's definition, the whole product formed -------------------


def _np_layer(probs: np.ndarray, fusion: str, discard: float) -> np.ndarray:
    """One layer's Â from its (heads, T, T) probabilities."""
    fused = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](probs, axis=0)
    t = fused.shape[-1]
    flat = fused.reshape(-1).copy()
    flat[np.argsort(flat, kind="stable")[: int(discard * t * t)]] = 0.0
    mixed = 0.5 * flat.reshape(t, t) + 0.5 * np.eye(t)
    return mixed / mixed.sum(axis=1, keepdims=True)


def _np_rollout(layers: list[np.ndarray], fusion: str, discard: float, start: int) -> np.ndarray:
    """Â_L · … · Â_start, each layer (heads, T, T)."""
    t = layers[0].shape[-1]
    product = np.eye(t)
    for probs in layers[start:]:
        product = _np_layer(probs.astype(np.float64), fusion, discard) @ product
    return product


# --- the arithmetic by hand ------------------------------------------------------------


def _t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_two_layers_by_hand():
    # Â1 = (A1 + I)/2 = [[1, 0], [.25, .75]], Â2 = [[.75, .25], [0, 1]];
    # Â2·Â1 = [[.75 + .0625, .1875], [.25, .75]].
    a1 = with_residual(_t([[1.0, 0.0], [0.5, 0.5]])[None])
    a2 = with_residual(_t([[0.5, 0.5], [0.0, 1.0]])[None])
    assert torch.equal(a1[0], _t([[1.0, 0.0], [0.25, 0.75]]))
    for row, expected in ((0, [0.8125, 0.1875]), (1, [0.25, 0.75])):
        got = rollout_rows([a1, a2], torch.tensor([row]))
        torch.testing.assert_close(got[0], _t(expected), rtol=0, atol=1e-15)


def test_head_fusion_by_hand():
    heads = _t([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [1.0, 0.0]]])[None]  # (1, 2, 2, 2)
    assert torch.equal(fuse_heads(heads, "mean")[0], _t([[0.5, 0.5], [0.75, 0.25]]))
    assert torch.equal(fuse_heads(heads, "min")[0], _t([[0.0, 0.0], [0.5, 0.0]]))
    # max [[1, 1], [1, .5]] + I = [[2, 1], [1, 1.5]], halved; rows summing to 1.5 and 1.25.
    got = with_residual(fuse_heads(heads, "max"))[0]
    torch.testing.assert_close(got, _t([[2 / 3, 1 / 3], [0.4, 0.6]]), rtol=0, atol=1e-15)
    # min [[0, 0], [.5, 0]] + I = [[1, 0], [.5, 1]]: rows [1, 0] and [1/3, 2/3].
    got = with_residual(fuse_heads(heads, "min"))[0]
    torch.testing.assert_close(got, _t([[1.0, 0.0], [1 / 3, 2 / 3]]), rtol=0, atol=1e-15)
    with pytest.raises(ValueError):
        fuse_heads(heads, "median")


def test_discard_by_hand():
    # Half of four entries: 0.1 and 0.3 go; (A + I)/2 is then diagonal, rows 1 after norming.
    kept = discard_lowest(_t([[0.9, 0.1], [0.3, 0.7]])[None], 0.5)
    assert torch.equal(kept[0], _t([[0.9, 0.0], [0.0, 0.7]]))
    assert torch.equal(with_residual(kept)[0], torch.eye(2, dtype=torch.float64))
    # Ties: the first in row-major order goes first.
    kept = discard_lowest(_t([[0.5, 0.5], [0.5, 0.5]])[None], 0.25)
    assert torch.equal(kept[0], _t([[0.0, 0.5], [0.5, 0.5]]))
    got = with_residual(kept)[0]  # [[1, .5], [.5, 1.5]] / 2, rows normed
    torch.testing.assert_close(got, _t([[2 / 3, 1 / 3], [0.25, 0.75]]), rtol=0, atol=1e-15)
    # 0.2 of 4 entries is none (floor): the matrix as it was.
    same = _t([[0.9, 0.1], [0.3, 0.7]])[None]
    assert discard_lowest(same, 0.2) is same
    # Padding (the mask) is not ranked: a row discards as it would alone.
    padded = _t([[[0.9, 0.1, 0.0], [0.3, 0.7, 0.0], [0.2, 0.2, 0.6]]])
    real = torch.tensor([[True, True, False]])
    kept = discard_lowest(padded, 0.5, real)[0]
    assert torch.equal(kept[:2, :2], _t([[0.9, 0.0], [0.0, 0.7]]))
    assert torch.equal(kept[2], padded[0, 2])


# --- GPT-2 from a small config -----------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    model, kind = save_lm(folder / "lm", "gpt2", n_layer=3)
    data = write_jsonl(folder / "p.jsonl", PROMPTS)
    return model, prompt_run(folder / "lm", kind, data)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpt2_rollout_equals_numpy_on_output_attentions(gpt2, tmp_path, variant):
    model, overrides = gpt2
    result = run_config(tmp_path, ["experiment=attention_rollout", *overrides, *_options(*variant)])
    with h5py.File(result.path) as f:
        got = f["derived/attention_rollout/input"][:]
        tokens, mask = f["samples/tokens"][:], f["samples/mask"][:]
    assert got.shape == tokens.shape and got.dtype == np.float32
    for n in range(len(tokens)):
        ids = tokens[n][mask[n]]
        with torch.no_grad():  # the prompt alone: no padding in the reference
            out = model(input_ids=torch.from_numpy(ids)[None], output_attentions=True)
        layers = [a[0].double().numpy() for a in out.attentions]
        expected = _np_rollout(layers, *variant)[len(ids) - 1]  # the read position: the last
        np.testing.assert_allclose(got[n, : len(ids)], expected, rtol=1e-5, atol=1e-7)
        assert not got[n, len(ids) :].any()  # padding reaches nothing
        # Rows of a product of row-stochastic matrices sum to 1.
        assert got[n].sum() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_a_fused_gpt2_runs_eager_and_comes_back_as_it_was(tmp_path):
    from hookrun.models.language import LanguageModel

    tok = tokenizer()
    cfg = transformers.AutoConfig.for_model(**FAMILIES["gpt2"][1], vocab_size=len(tok) + 4)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    ids = torch.tensor([tok("The cat sat")["input_ids"]])
    with torch.no_grad():
        before = hf(input_ids=ids).logits
    params = {n: p.detach().clone() for n, p in hf.named_parameters()}
    grads = {n: p.requires_grad for n, p in hf.named_parameters()}
    args = ["experiment=attention_rollout", f"dataset.path={data}", "render=false"]
    result = hookrun.run(args, model=LanguageModel(hf, tok), run_dir=tmp_path / "run")
    assert hf.config._attn_implementation == "sdpa"
    assert all(torch.equal(p, params[n]) for n, p in hf.named_parameters())
    assert {n: p.requires_grad for n, p in hf.named_parameters()} == grads
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in hf.modules())
    assert not hf.training
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, before)
    with h5py.File(result.path) as f:
        got, mask = f["derived/attention_rollout/input"][:], f["samples/mask"][:]
    hf.set_attn_implementation("eager")  # the reference: the model's eager probabilities
    with h5py.File(result.path) as f:
        tokens = f["samples/tokens"][:]
    for n in range(len(tokens)):
        row = tokens[n][mask[n]]
        with torch.no_grad():
            out = hf(input_ids=torch.from_numpy(row)[None], output_attentions=True)
        expected = _np_rollout([a[0].double().numpy() for a in out.attentions], "mean", 0, 0)
        np.testing.assert_allclose(got[n, : len(row)], expected[-1], rtol=1e-5, atol=1e-7)


# --- torchvision's ViT -------------------------------------------------------------------


def _vit(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    net = torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=layers,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=10,
    )
    nn.init.normal_(net.heads.head.weight)
    # Larger query and key weights than the init's: attention far from uniform.
    with torch.no_grad():
        for block in net.encoder.layers:
            block.self_attention.in_proj_weight.mul_(4.0)
    return net.eval()


def _images(count: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, 32, 32, generator=gen) for _ in range(count)]


def _vit_probabilities(net: nn.Module, x: torch.Tensor) -> list[np.ndarray]:
    """Each block's probabilities (N, heads, T, T), recomputed from its LayerNorm'd input and
    in_proj weights in float64, checked against the module asked for its weights."""
    inputs: list[torch.Tensor] = []
    handles = [
        b.ln_1.register_forward_hook(lambda m, a, out: inputs.append(out.detach()))
        for b in net.encoder.layers
    ]
    try:
        with torch.no_grad():
            net(x)
    finally:
        for h in handles:
            h.remove()
    out = []
    for block, y in zip(net.encoder.layers, inputs, strict=True):
        mha = block.self_attention
        w = mha.in_proj_weight.detach().double()
        b = mha.in_proj_bias.detach().double()
        e, heads = mha.embed_dim, mha.num_heads
        d = e // heads
        q = (y.double() @ w[:e].T + b[:e]).view(len(y), -1, heads, d).transpose(1, 2)
        k = (y.double() @ w[e : 2 * e].T + b[e : 2 * e]).view(len(y), -1, heads, d).transpose(1, 2)
        probs = torch.softmax(q @ k.transpose(-2, -1) / np.sqrt(d), dim=-1)
        with torch.no_grad():
            _, asked = mha(y, y, y, need_weights=True, average_attn_weights=False)
        torch.testing.assert_close(probs.float(), asked, rtol=1e-5, atol=1e-6)
        out.append(probs.numpy())
    return out


def _vit_expected(net: nn.Module, images: list[torch.Tensor], variant: tuple) -> np.ndarray:
    probs = _vit_probabilities(net, torch.stack(images))
    rows = []
    for n in range(len(images)):
        rollout = _np_rollout([p[n] for p in probs], *variant)
        rows.append(rollout[0, 1:].reshape(4, 4))  # the class token's row over 4 x 4 patches
    return np.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_vit_rollout_equals_numpy_on_recomputed_probabilities(tmp_path, variant):
    net, images = _vit(), _images()
    args = ["experiment=attention_rollout", "render=false", "progress=false", *_options(*variant)]
    result = hookrun.run(args, model=net, dataset=images, run_dir=tmp_path)
    with h5py.File(result.path) as f:
        got = f["derived/attention_rollout/input"][:]
        dims = [d[0].name for d in f["derived/attention_rollout/input"].dims]
    assert got.shape == (2, 4, 4)
    assert dims == ["/sample", "/derived/attention_rollout/y", "/derived/attention_rollout/x"]
    np.testing.assert_allclose(got, _vit_expected(net, images, variant), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_vit_leaves_the_run_as_it_came(tmp_path):
    net, images = _vit(2), _images()
    x = torch.stack(images)
    with torch.no_grad():
        before = net(x)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    grads = {n: p.requires_grad for n, p in net.named_parameters()}
    net.train()  # a caller's model in training mode comes back in it
    args = ["experiment=attention_rollout", "progress=false"]
    result = hookrun.run(args, model=net, dataset=images, run_dir=tmp_path)
    assert net.training
    net.eval()
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    assert {n: p.requires_grad for n, p in net.named_parameters()} == grads
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())
    with torch.no_grad():
        assert torch.equal(net(x), before)
    with h5py.File(result.path) as f:
        got = f["derived/attention_rollout/input"][:]
    np.testing.assert_allclose(got, _vit_expected(net, images, VARIANTS[0]), rtol=1e-5, atol=1e-7)
    # The map is drawn over the photo, upsampled to its pixels.
    drawn = sorted(p.name for p in result.images.glob("*.png"))
    assert "00000_attention_rollout_input.png" in drawn and "contact_sheet.png" in drawn


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("head_fusion=median", "head_fusion: 'median'; valid: mean, max, min"),
        ("discard_ratio=1.0", "discard_ratio: 1.0 is out of range; valid: a number in [0, 1)"),
        ("discard_ratio=-0.1", "discard_ratio: -0.1 is out of range; valid: a number in [0, 1)"),
        ("start_layer=-1", "start_layer: -1 is out of range; valid: >= 0"),
    ],
)
def test_bad_options_are_refused_at_config_time(override, words):
    from conftest import compose_config

    from hookrun.config.build import build_spec

    with pytest.raises(HookrunError) as err:
        build_spec(compose_config(["experiment=attention_rollout", f"{KEY}.{override}"]))
    assert str(err.value) == f"{KEY}.{words}" or str(err.value).startswith(f"{KEY}.{words}")
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_start_layer_past_the_last_is_refused_before_any_work(tmp_path):
    args = ["experiment=attention_rollout", f"{KEY}.start_layer=3", "render=false"]
    with pytest.raises(HookrunError) as err:
        hookrun.run(args, model=_vit(3), dataset=_images(), run_dir=tmp_path)
    assert str(err.value) == (
        f"{KEY}.start_layer: 3 is out of range; valid: 0 to 2 (the model's 3 attention layers)"
    )
    assert not (tmp_path / "captures.h5").exists()


@pytest.mark.slow
def test_a_model_without_attention_is_refused_before_any_work(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))
    net(torch.zeros(1, 3, 32, 32))
    args = ["experiment=attention_rollout", "render=false"]
    with pytest.raises(HookrunError) as err:
        hookrun.run(args, model=net, dataset=_images(), run_dir=tmp_path)
    message = str(err.value)
    assert message.startswith(f"{KEY}: Sequential has no attention modules found")
    assert "valid: torchvision's VisionTransformer" in message and "\n" not in message
    assert not (tmp_path / "captures.h5").exists()


class _MaskedAttention(nn.Module):
    """A class token and 4 patches through an nn.MultiheadAttention called with a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.class_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.embed = nn.Conv2d(3, 8, 16, stride=16)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.class_token.expand(len(x), -1, -1), tokens], dim=1)
        mask = torch.zeros(len(x), tokens.shape[1], dtype=torch.bool)
        out, _ = self.attention(tokens, tokens, tokens, key_padding_mask=mask)
        return self.head(out[:, 0])


@pytest.mark.slow
def test_a_masked_multihead_attention_call_is_refused_before_any_work(tmp_path):
    torch.manual_seed(0)
    args = ["experiment=attention_rollout", "render=false"]
    with pytest.raises(HookrunError) as err:
        hookrun.run(args, model=_MaskedAttention(), dataset=_images(), run_dir=tmp_path)
    assert str(err.value) == (
        f"{KEY}: attention is called with key_padding_mask, which attention rollout does not "
        "read; valid: self-attention without masks or extra keys (torchvision's ViT)"
    )
    assert not (tmp_path / "captures.h5").exists()


@pytest.mark.slow
def test_llama_rollout_equals_numpy_on_output_attentions(tmp_path):
    model, kind = save_lm(tmp_path / "lm", "llama")  # grouped-query attention: 2 heads, 1 kv
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    overrides = ["experiment=attention_rollout", *prompt_run(tmp_path / "lm", kind, data)]
    result = run_config(tmp_path / "run", [*overrides, *_options("max", 0.2, 0)])
    with h5py.File(result.path) as f:
        got = f["derived/attention_rollout/input"][:]
        tokens, mask = f["samples/tokens"][:], f["samples/mask"][:]
    for n in range(len(tokens)):
        ids = tokens[n][mask[n]]
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids)[None], output_attentions=True)
        expected = _np_rollout([a[0].double().numpy() for a in out.attentions], "max", 0.2, 0)
        np.testing.assert_allclose(got[n, : len(ids)], expected[-1], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_experiment_as_shipped_draws_the_token_picture(tmp_path):
    from PIL import Image

    result = run_config(tmp_path, ["experiment=attention_rollout", "limit=3"], "attention_rollout")
    with h5py.File(result.path) as f:
        ds = f["derived/attention_rollout/input"]
        assert ds.shape == f["samples/tokens"].shape
        assert [d[0].name for d in ds.dims] == ["/sample", "/derived/attention_rollout/token"]
        rows, mask = ds[:], f["samples/mask"][:]
    np.testing.assert_allclose(rows.sum(1), 1.0, atol=1e-5)
    assert not rows[~mask].any()
    # tiny_lm's rows: no photo is drawn from token ids, the rollout is drawn over the tokens.
    assert sorted(p.name for p in result.images.glob("*.png")) == ["token_attributions.png"]
    pixels = np.asarray(Image.open(result.images / "token_attributions.png").convert("RGB"))
    assert min(pixels.shape[:2]) >= 200 and pixels.std() > 5
