"""hookrun.training.dictionary's losses, schedules, state and saved folders, by hand.

Every loss is checked on a few numbers whose expected value is written out here (by hand,
or by the direct formula on the same small tensors), not computed by the code under test:
`Trainer.step` returns the metrics of the forward pass before its update.
"""

from __future__ import annotations

import json

import pytest
import torch

from hookrun.dictionaries import load_dictionaries
from hookrun.training.dictionary import Hyper, Trainer, lr_factor, warmup_coefficient
from hookrun.training.gradients import JumpReLU, ReluCode, Scratch, Step


def _trainer(architecture: str, d: int = 2, width: int = 3, **kw) -> Trainer:
    return Trainer(Hyper(architecture, d, d, width, **kw), torch.Generator().manual_seed(0))


def _set(trainer: Trainer, **tensors: list) -> None:
    with torch.no_grad():
        for name, value in tensors.items():
            trainer.params[name].copy_(torch.tensor(value))


# W_enc [2, 3], W_dec [3, 2] (rows of norm 1, 2 and 0.5), b_dec [2], b_enc [3]
W_ENC = [[1.0, 0.0, -1.0], [0.0, 1.0, 1.0]]
W_DEC = [[1.0, 0.0], [0.0, 2.0], [0.3, 0.4]]
B_DEC = [0.5, 0.0]
B_ENC = [0.0, -0.5, 0.25]
X = torch.tensor([[1.5, 1.0], [0.5, 2.0]])


def test_relu_loss_by_hand() -> None:
    t = _trainer("relu", l1_coefficient=2.0)
    _set(t, W_enc=W_ENC, W_dec=W_DEC, b_dec=B_DEC, b_enc=B_ENC)
    m = t.step(X)
    # x - b_dec = [1, 1], [0, 2]; pre = [1, 0.5, 0.25], [0, 1.5, 2.25]; z = relu(pre)
    # out = z W_dec + b_dec = [1 + .075 + .5, 1 + .1], [0 + .675 + .5, 3 + .9]
    #     = [1.575, 1.1], [1.175, 3.9]; errors [.075, .1], [.675, 1.9]
    mse = ((0.075**2 + 0.1**2) + (0.675**2 + 1.9**2)) / 2
    # l1 = 2 * mean_t sum_i z_i ||W_dec_i||: [1 + 1 + .125], [0 + 3 + 1.125]
    l1 = 2.0 * (2.125 + 4.125) / 2
    assert m["mse"] == pytest.approx(mse, rel=1e-6)
    assert m["l1"] == pytest.approx(l1, rel=1e-6)
    assert m["loss"] == pytest.approx(mse + l1, rel=1e-6)
    assert m["l0"] == pytest.approx(2.5)
    var = ((X - X.mean(0)) ** 2).sum(-1).mean().item()  # 0.25 + 0.25 per token
    assert m["explained_variance"] == pytest.approx(1 - mse / var, rel=1e-6)


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("b_dec_in", [True, False])
def test_relu_written_out_gradients_equal_autograd_of_the_formula(
    b_dec_in: bool, scratch: bool
) -> None:
    """relu's hand-written backward (ReluCode) against autograd through the plain formula
    (pre = (x - b_dec) W_enc + b_enc, z = relu(pre), z W_dec + b_dec, L1 = sum z ||W_dec||),
    in float64, some latents cut by the relu and one never firing; with a Scratch, over
    three steps whose buffers are the same memory (a batch of another size between)."""
    g = torch.Generator().manual_seed(3)
    kept = Scratch() if scratch else None
    for rows in (7, 5, 7):
        x = torch.randn(rows, 4, generator=g, dtype=torch.float64)
        w_enc = torch.randn(4, 6, generator=g, dtype=torch.float64)
        b_enc = torch.randn(6, generator=g, dtype=torch.float64)
        b_enc[2] = -100.0  # a latent that never fires
        w_dec = torch.randn(6, 4, generator=g, dtype=torch.float64)
        b_dec = torch.randn(4, generator=g, dtype=torch.float64)
        target = torch.randn(rows, 4, generator=g, dtype=torch.float64)

        def loss(core: torch.Tensor, l1: torch.Tensor, target=target) -> torch.Tensor:
            return (core - target).pow(2).sum() + 0.7 * l1

        leaves = [t.clone().requires_grad_() for t in (w_enc, b_enc, w_dec, b_dec)]
        core, l1, fired = ReluCode.apply(x, *leaves, b_dec_in, kept)
        loss(core, l1).backward()
        ours = [t.grad for t in leaves]

        ref = [t.clone().requires_grad_() for t in (w_enc, b_enc, w_dec, b_dec)]
        we, be, wd, bd = ref
        z = torch.relu(((x - bd) if b_dec_in else x) @ we + be)
        loss(z @ wd + bd, (z * wd.norm(dim=1)).sum()).backward()
        for name, a, b in zip(("W_enc", "b_enc", "W_dec", "b_dec"), ours, ref, strict=True):
            torch.testing.assert_close(a, b.grad, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(core, z @ wd + bd, rtol=1e-12, atol=1e-12)
        assert torch.equal(fired, (z > 0).sum(0))
        assert fired[2] == 0


def test_l1_warmup_and_lr_schedule_by_hand() -> None:
    assert [warmup_coefficient(2.0, 4, s) for s in (0, 1, 2, 4, 9)] == [0, 0.5, 1.0, 2.0, 2.0]
    h = Hyper("relu", 2, 2, 3, lr_warmup_steps=4, lr_decay_steps=2, total_steps=10)
    factors = [lr_factor(h, s) for s in range(10)]
    assert factors == [0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1, 0.5]
    t = _trainer(
        "relu", l1_coefficient=2.0, l1_warmup_steps=4, lr=0.1, lr_warmup_steps=4, total_steps=10
    )
    first = t.step(X)
    assert first["l1"] == 0.0 and first["lr"] == pytest.approx(0.025)
    assert t.step(X)["l1_coefficient"] == pytest.approx(0.5)


def test_topk_loss_and_aux_k_by_hand() -> None:
    t = _trainer("topk", k=1, aux_k_coefficient=0.5, dead_tokens=0)
    _set(t, W_enc=W_ENC, W_dec=W_DEC, b_dec=B_DEC, b_enc=B_ENC)
    # latent 0 fired before; latents 1 and 2 are dead (not fired for > 0 tokens)
    t.tokens_since_fired[:] = torch.tensor([0, 5, 5])
    m = t.step(X)
    # pre times ||W_dec_i|| (1, 2, .5): [1, 1, .125], [0, 3, 1.125]; top 1 (ties: the
    # lowest index, torch's topk on CPU) -> token 0: latent 0 = 1, token 1: latent 1 = 3;
    # decoded z / ||W_dec_i||: [1, 0] + b_dec = [1.5, 0], and 1.5 * [0, 2] + b_dec = [.5, 3]
    err = torch.tensor([[0.0, 1.0], [0.0, -1.0]])  # x - out
    mse = (err**2).sum(-1).mean().item()
    # AuxK: d/2 = 1 dead latent per token, scale min(2 dead / 1, 1) = 1: the largest dead
    # scaled pre-activation (token 0: latent 1 = 1; token 1: latent 1 = 3), decoded through
    # W_dec / norm without bias: [0, 1] and [0, 3], against the residual err
    aux = 0.5 * (((torch.tensor([[0.0, 1.0], [0.0, 3.0]]) - err) ** 2).sum(-1).mean().item())
    assert m["mse"] == pytest.approx(mse, rel=1e-6)
    assert m["aux"] == pytest.approx(aux, rel=1e-6)
    assert m["loss"] == pytest.approx(mse + aux, rel=1e-6)
    assert m["l0"] == 1.0


def test_batchtopk_and_its_threshold_by_hand() -> None:
    t = _trainer("batchtopk", k=1, topk_threshold_lr=0.01)
    _set(t, W_enc=W_ENC, W_dec=W_DEC, b_dec=B_DEC, b_enc=B_ENC)
    m = t.step(X)
    # scaled pre [1, 1, .125], [0, 3, 1.125]: the batch's top k * B = 2 are both token 1's
    # (3 at latent 1, 1.125 at latent 2); token 0 keeps none: out = b_dec, error [1, 1];
    # token 1: 3 / 2 * [0, 2] + 1.125 / .5 * [.3, .4] + b_dec = [1.175, 3.9], error
    # [.675, 1.9]
    mse = (2.0 + (0.675**2 + 1.9**2)) / 2
    assert m["mse"] == pytest.approx(mse, rel=1e-6)
    assert m["l0"] == 1.0
    # threshold: 0.99 * 0 + 0.01 * (the smallest positive activation: 1.125)
    assert t.topk_threshold.item() == pytest.approx(0.01125)
    assert m["topk_threshold"] == pytest.approx(0.01125)


def test_matryoshka_inner_losses_by_hand() -> None:
    t = _trainer("matryoshka_batchtopk", k=1, matryoshka_widths=(1, 3))
    _set(t, W_enc=W_ENC, W_dec=W_DEC, b_dec=B_DEC, b_enc=B_ENC)
    m = t.step(X)
    # as batchtopk (mse (2 + .675^2 + 1.9^2) / 2); the inner level (latent 0 only, which
    # neither token keeps) is b_dec: errors [1, 1] and [0, 2]
    inner = ((1.0 + 1.0) + (0.0 + 4.0)) / 2
    assert m["inner_mse_1"] == pytest.approx(inner, rel=1e-6)
    mse = (2.0 + (0.675**2 + 1.9**2)) / 2
    assert m["loss"] == pytest.approx(mse + inner, rel=1e-6)


def test_jumprelu_loss_by_hand() -> None:
    t = _trainer("jumprelu", l0_coefficient=0.5)
    _set(t, W_enc=W_ENC, W_dec=W_DEC, b_dec=B_DEC, b_enc=B_ENC, threshold=[0.9, 0.6, 0.3])
    m = t.step(X)
    # pre [1, .5, .25], [0, 1.5, 2.25] over thresholds [.9, .6, .3]: z = [1, 0, 0],
    # [0, 1.5, 2.25]; out = [1.5, 0], [.675 + .5, 3 + .9] = [1.175, 3.9]
    mse = ((0.0 + 1.0) + (0.675**2 + 1.9**2)) / 2
    assert m["mse"] == pytest.approx(mse, rel=1e-6)
    assert m["l0_loss"] == pytest.approx(0.5 * (1 + 2) / 2, rel=1e-6)
    assert m["l0"] == pytest.approx(1.5)


def test_jumprelu_straight_through_gradients_by_hand() -> None:
    pre = torch.tensor([[0.50, 0.12], [0.11, 0.30]], requires_grad=True)
    threshold = torch.tensor([0.49, 0.10], requires_grad=True)
    bw = 0.05
    JumpReLU.apply(pre, threshold, bw).sum().backward()
    # d/dpre: 1 where pre > threshold; d/dthreshold: -(threshold / bw) * #(|pre - t| < bw/2)
    assert pre.grad.tolist() == [[1.0, 1.0], [0.0, 1.0]]
    # latent 0: |.5 - .49| < .025 (1 token); latent 1: |.12 - .1|, |.3 - .1| -> 1 token
    torch.testing.assert_close(threshold.grad, torch.tensor([-0.49 / bw, -0.10 / bw]))
    threshold.grad = None
    pre2 = pre.detach().requires_grad_()
    Step.apply(pre2, threshold, bw).sum().backward()
    assert pre2.grad is None  # the L0's estimator reaches the threshold only
    torch.testing.assert_close(threshold.grad, torch.tensor([-1 / bw, -1 / bw]))


ARCHS = {
    "relu": {},
    "topk": {"k": 4},
    "batchtopk": {"k": 4},
    "jumprelu": {},
    "matryoshka_batchtopk": {"k": 4, "matryoshka_widths": (8, 32)},
}


def _batches(n: int, d: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(64, d, generator=g) for _ in range(n)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_state_dict_continues_bit_for_bit(arch: str) -> None:
    kw = dict(ARCHS[arch], dead_tokens=64, feature_sampling_window=4, lr=1e-2, total_steps=8)
    kw |= {"lr_warmup_steps": 2, "lr_decay_steps": 3}
    batches = _batches(8)
    h = Hyper(arch, 16, 16, 32, **kw)
    a = Trainer(h, torch.Generator().manual_seed(1))
    for x in batches[:4]:
        a.step(x)
    state = a.state_dict()
    for x in batches[4:]:
        a.step(x)
    b = Trainer(h, torch.Generator().manual_seed(2))  # other weights, all overwritten
    b.load_state_dict(state)
    for x in batches[4:]:
        b.step(x)
    for name, p in a.params.items():
        assert torch.equal(p, b.params[name]), name
    assert torch.equal(a.tokens_since_fired, b.tokens_since_fired)
    assert torch.equal(a.fired_counts, b.fired_counts)
    assert torch.equal(a.topk_threshold, b.topk_threshold)
    # the same generator state and batches: the same dictionary
    c = Trainer(h, torch.Generator().manual_seed(1))
    for x in batches:
        c.step(x)
    assert all(torch.equal(p, c.params[n]) for n, p in a.params.items())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_saved_folder_loads_in_hookrun_with_the_same_latents(arch: str, tmp_path) -> None:
    h = Hyper(arch, 16, 16, 32, scale=2.0, **ARCHS[arch])
    t = Trainer(h, torch.Generator().manual_seed(1))
    for x in _batches(3):
        t.step(x)
    folder = tmp_path / "sae"
    folder.mkdir()
    (folder / "stale").write_text("replaced whole")
    t.save(folder, "blocks.0.hook_resid_pre", {"model_name": "m"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sae"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "cfg.json",
        "sae_weights.safetensors",
        "sparsity.safetensors",
    ]
    cfg = json.loads((folder / "cfg.json").read_text())
    assert cfg["architecture"] == {"relu": "standard", "topk": "topk"}.get(arch, "jumprelu")
    assert cfg["normalize_activations"] == "none"
    assert cfg["metadata"]["hook_name"] == "blocks.0.hook_resid_pre"
    (d,) = load_dictionaries(folder, "test")
    x = _batches(1)[0]
    z = t.encode(x)
    assert torch.equal(d.encode(x), z)
    if arch in ("relu", "jumprelu"):
        # the scale folded out: the saved dictionary on x is the trained one on 2x, / 2
        with torch.no_grad():
            p = t.params
            pre = (2 * x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]
            live = pre > (p["threshold"] if arch == "jumprelu" else 0)
            out = (pre * live) @ p["W_dec"] + p["b_dec"]
        torch.testing.assert_close(d.decode(z), out / 2, rtol=1e-5, atol=1e-6)


def test_transcoder_saves_as_saelens_names_it(tmp_path) -> None:
    h = Hyper("relu", 8, 6, 16, transcoder=True, skip=True)
    t = Trainer(h, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 6, generator=g)
    m = t.step(x, y)
    assert set(m) >= {"loss", "mse", "l1", "explained_variance", "dead", "lr"}
    t.save(
        tmp_path / "tc", "blocks.0.ln2.hook_normalized", {"hook_name_out": "blocks.0.hook_mlp_out"}
    )
    cfg = json.loads((tmp_path / "tc" / "cfg.json").read_text())
    assert cfg["architecture"] == "skip_transcoder" and cfg["d_out"] == 6
    assert cfg["apply_b_dec_to_input"] is False
    (d,) = load_dictionaries(tmp_path / "tc", "test")
    assert d.transcoder and d.hook_name_out == "blocks.0.hook_mlp_out"
    torch.testing.assert_close(d.decode(d.encode(x), x), t.decode(t.encode(x), x))


@pytest.mark.parametrize("arch", ["relu", "topk", "batchtopk", "jumprelu"])
def test_autocast_computes_in_bfloat16_and_keeps_float32_parameters(arch: str) -> None:
    """sae.dtype=bfloat16: the forward's matmuls in bfloat16 (SAELens's autocast), the
    parameters, gradients and Adam in float32; training still converges alike."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4000, 16, generator=g)
    kw = {"k": 4} if "topk" in arch else {}
    results = {}
    for low in (None, torch.bfloat16):
        t = Trainer(
            Hyper(arch, 16, 16, 64, total_steps=20, lr=3e-3, **kw),
            torch.Generator().manual_seed(0),
            autocast=low,
        )
        for i in range(20):
            m = t.step(x[i * 200 : (i + 1) * 200])
        assert all(p.dtype == torch.float32 for p in t.params.values())
        results[low] = (m["explained_variance"], t.params["W_enc"].detach().clone())
    (ev32, w32), (ev16, w16) = results[None], results[torch.bfloat16]
    assert not torch.equal(w32, w16)  # the bfloat16 rounding reached the updates
    assert abs(ev16 - ev32) < 0.02
