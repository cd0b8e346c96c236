"""One dictionary's training math (hookrun/training/dictionary.py) against the formulas
written out here, its state round trip, and its saved folder read back by hookrun's loader."""

from __future__ import annotations

import math

import pytest
import torch

from hookrun.dictionaries.load import load_dictionaries
from hookrun.training.dictionary import Hyper, Trainer

ARCHITECTURES = ("relu", "topk", "batchtopk", "jumprelu", "matryoshka_batchtopk")


def _hyper(arch: str, **extra) -> Hyper:
    base = {"k": 4} if arch not in ("relu", "jumprelu") else {}
    if arch == "matryoshka_batchtopk":
        base["matryoshka_widths"] = (8, 16, 32)
    return Hyper(arch, d_in=12, d_out=12, width=32, lr=1e-2, total_steps=50, **{**base, **extra})


def _data(n: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.rand(n, 40, generator=g) * (torch.rand(n, 40, generator=g) < 0.1)
    return codes @ torch.randn(40, 12, generator=g) + 0.01 * torch.randn(n, 12, generator=g)


def _trainer(hyper: Hyper, seed: int = 1) -> Trainer:
    return Trainer(hyper, torch.Generator().manual_seed(seed))


def test_initialisation_is_saelens_s():
    t = _trainer(_hyper("relu"))
    p = t.params
    torch.testing.assert_close(p["W_dec"].norm(dim=1), torch.full((32,), 0.1))
    assert torch.equal(p["W_enc"], p["W_dec"].T)
    assert not p["b_enc"].any() and not p["b_dec"].any()


def test_relu_loss_is_mse_plus_l1_times_decoder_norms():
    t = _trainer(_hyper("relu", l1_coefficient=0.3))
    x = _data(16)
    p = {k: v.detach().clone() for k, v in t.params.items()}
    z = torch.relu((x - p["b_dec"]) @ p["W_enc"] + p["b_enc"])
    mse = ((z @ p["W_dec"] + p["b_dec"] - x) ** 2).sum(-1).mean()
    l1 = (z * p["W_dec"].norm(dim=1)).sum(-1).mean()
    got = t.step(x)
    assert got["loss"] == pytest.approx(float(mse + 0.3 * l1), rel=1e-6)
    assert got["mse"] == pytest.approx(float(mse), rel=1e-6)


def test_l1_and_lr_warm_up_and_decay():
    t = _trainer(_hyper("relu", l1_warmup_steps=4, lr_warmup_steps=2, lr_decay_steps=10))
    rates = [t.step(_data(8, s))["lr"] for s in range(50)]
    assert rates[0] == pytest.approx(0.5e-2) and rates[1] == pytest.approx(1e-2)
    assert rates[40] == pytest.approx(1e-2)  # 10 steps left: the decay's first
    assert rates[49] == pytest.approx(1e-3)  # the last: 1 of 10 left


def test_topk_keeps_k_latents_and_its_loss_is_the_mse_before_any_latent_died():
    t = _trainer(_hyper("topk"))
    x = _data(16)
    p = {k: v.detach().clone() for k, v in t.params.items()}
    pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    top = pre.topk(4, dim=-1)
    z = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    mse = ((z @ p["W_dec"] + p["b_dec"] - x) ** 2).sum(-1).mean()
    got = t.step(x)
    assert got["loss"] == pytest.approx(float(mse), rel=1e-6)  # no dead latent: AuxK is 0
    assert (t.encode(x) != 0).sum(-1).max() <= 4


def test_aux_k_reconstructs_the_residual_from_dead_latents():
    t = _trainer(_hyper("topk", dead_steps=0))
    x = _data(16)
    t.since_fired[:] = 1  # every latent dead
    p = {k: v.detach().clone() for k, v in t.params.items()}
    pre = (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
    top = pre.topk(4, dim=-1)
    z = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    out = z @ p["W_dec"] + p["b_dec"]
    residual = x - out
    k_aux = 12 // 2  # d_in / 2, fewer than the 32 dead: scale 1
    aux_top = pre.topk(k_aux, dim=-1)
    aux = torch.zeros_like(pre).scatter(-1, aux_top.indices, aux_top.values.relu()) @ p["W_dec"]
    expected = ((out - x) ** 2).sum(-1).mean() + ((aux - residual) ** 2).sum(-1).mean() / 32
    assert t.step(x)["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_batchtopk_keeps_k_per_token_over_the_batch_and_learns_a_threshold():
    t = _trainer(_hyper("batchtopk"))
    x = _data(64)
    t.step(x)
    assert float(t.threshold) > 0
    for s in range(30):
        t.step(_data(64, s + 1))
    z = t.encode(_data(64, 99))
    assert 1 <= float((z != 0).sum(-1).double().mean()) <= 16


def test_jumprelu_threshold_gets_the_straight_through_gradient():
    h = _hyper("jumprelu", jumprelu_bandwidth=10.0, jumprelu_init_threshold=0.5)
    t = _trainer(h)
    before = t.params["log_threshold"].detach().clone()
    t.step(_data(32))
    assert not torch.equal(before, t.params["log_threshold"].detach())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_resumed_state_goes_on_bit_for_bit(arch: str):
    a = _trainer(_hyper(arch))
    for s in range(5):
        a.step(_data(32, s))
    state = a.state_dict()
    b = _trainer(_hyper(arch), seed=7)  # other initial weights: all come from the state
    b.load_state_dict(state)
    for s in range(5, 10):
        a.step(_data(32, s))
        b.step(_data(32, s))
    for key in a.params:
        assert torch.equal(a.params[key], b.params[key]), key


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_the_saved_folder_loads_and_encodes_as_the_trainer(arch: str, scale: float, tmp_path):
    t = _trainer(_hyper(arch, scale=scale))
    for s in range(20):
        t.step(_data(64, s))
    t.save(tmp_path / "d", "blocks.0.hook_resid_post", {"model_name": "m"})
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "cfg.json",
        "sae_weights.safetensors",
        "sparsity.safetensors",
    ]
    (loaded,) = load_dictionaries(tmp_path / "d", "path")
    x = _data(64, 123)
    torch.testing.assert_close(loaded.encode(x), t.encode(x), atol=1e-5, rtol=1e-5)
    z = t.encode(x)
    torch.testing.assert_close(loaded.decode(z), t.decode(z), atol=1e-5, rtol=1e-5)
    assert math.isfinite(float(loaded.decode(z).sum()))
