"""Function-level sites (`select.function`) and modules used only through their weights,
against plain autograd and a recording wrapper around torch.nn.functional.linear."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from any_models import Functional, family, images
from conftest import read
from torch import nn

import hookrun
from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.b(F.gelu(self.a(x))))


class TwoGelus(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.block = Block()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(x)))


def _hook(hook: str, at: str, action: str = "capture", **select: str) -> list[str]:
    out = [f"++hooks.{hook}.at={at}", f"++hooks.{hook}.action={action}"]
    return out + [f"++hooks.{hook}.select.{k}={v}" for k, v in select.items()]


def _run(model: nn.Module, xs, tmp_path, *hooks: str) -> dict:
    overrides = ["experiment=saliency", "render=false", "batch_size=2", *hooks]
    return read(hookrun.run(overrides, model=model, dataset=xs, run_dir=tmp_path).path)


def _vectors(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(6, generator=g) for _ in range(n)]


def test_each_call_of_a_function_is_its_own_site(tmp_path):
    hooks = [*_hook("g", "output", function="gelu"), *_hook("gg", "grad_output", function="gelu")]
    data = _run(TwoGelus(), _vectors(), tmp_path, *hooks)
    # Plain autograd reference: the two gelu outputs and their gradients.
    model = TwoGelus().eval()
    x = torch.stack(_vectors())
    h0 = F.gelu(model.block.a(x))
    h1 = F.gelu(model.block.b(h0))
    h0.retain_grad(), h1.retain_grad()
    out = model.head(torch.tanh(h1))
    target = out.argmax(dim=1)
    out.gather(1, target[:, None]).sum().backward()
    for k, h in enumerate((h0, h1)):
        np.testing.assert_allclose(data[f"captures/block/gelu.{k}/output"], h.detach(), rtol=1e-5)
        np.testing.assert_allclose(
            data[f"captures/block/gelu.{k}/grad_output"], h.grad, rtol=1e-5, atol=1e-7
        )
    assert "captures/model/tanh.0/output" not in data  # only the selected word


def test_function_selector_narrowed_to_modules(tmp_path):
    gelus = _hook("g", "output", function="gelu", name="block")
    data = _run(TwoGelus(), _vectors(), tmp_path, *gelus)
    assert "captures/block/gelu.1/output" in data
    # tanh is called by the root's forward, not inside `block`: nothing to act on.
    tanh = _hook("t", "output", function="tanh", name="block")
    with pytest.raises(HookrunError, match=r"hooks.t.select.function: \['tanh'\] is never called"):
        _run(TwoGelus(), _vectors(), tmp_path / "b", *tanh)


def test_unknown_function_word_lists_the_valid_ones(tmp_path):
    with pytest.raises(HookrunError, match=r"hooks.f.select.function: 'gelo' .*did you mean: gelu"):
        _run(TwoGelus(), _vectors(), tmp_path, *_hook("f", "output", function="gelo"))


class WeightUser(nn.Module):
    """Uses `proj`'s weight through F.linear without calling `proj` (as attention code does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(9)
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(F.linear(x, self.proj.weight, self.proj.bias)))


def test_module_used_through_its_weight_is_captured_at_that_call(tmp_path):
    hooks = [*_hook("p", "output", name="proj"), *_hook("pg", "grad_output", name="proj")]
    hooks += _hook("pi", "input", name="proj")
    data = _run(WeightUser(), _vectors(), tmp_path, *hooks)
    model = WeightUser().eval()
    x = torch.stack(_vectors())
    h = F.linear(x, model.proj.weight, model.proj.bias)
    h.retain_grad()
    out = model.head(torch.relu(h))
    out.gather(1, out.argmax(dim=1)[:, None]).sum().backward()
    np.testing.assert_allclose(data["captures/proj/input"], x, rtol=1e-6)  # not the weight
    np.testing.assert_allclose(data["captures/proj/output"], h.detach(), rtol=1e-5)
    np.testing.assert_allclose(data["captures/proj/grad_output"], h.grad, rtol=1e-5, atol=1e-7)


def _swin_windows(x: torch.Tensor, window: int = 7) -> torch.Tensor:
    """torchvision's shifted_window_attention partition, written out for an unshifted block:
    (N, H, W, C) padded to whole windows → (N, windows, window², C), sample by sample."""
    n, h, w, c = x.shape
    x = F.pad(x, (0, 0, 0, -w % window, 0, -h % window))
    rows, cols = x.shape[1] // window, x.shape[2] // window
    x = x.view(n, rows, window, cols, window, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, rows * cols, window * window, c)


def test_swin_qkv_on_windows_folded_into_the_batch_is_stored_per_sample(tmp_path):
    # Swin calls F.linear with qkv's weight on (N * windows, 49, C): the probe checks the
    # fold is sample by sample, so each sample's windows are stored as (N, windows, 49, 3C).
    model = family("swin_t")
    with torch.no_grad():  # torchvision's init leaves qkv's bias at zero: make it count
        for p in model.parameters():
            if p.dim() == 1 and not p.abs().sum():
                p.normal_(0, 0.1)
    xs = images(32, n=3)
    block = "features.1.0"
    hooks = [*_hook("q", "output", name=f"{block}.attn.qkv")]
    hooks += _hook("qg", "grad_output", name=f"{block}.attn.qkv")
    hooks += _hook("n", "output", name=f"{block}.norm1")
    data = _run(model, xs, tmp_path, *hooks)
    # Reference: norm1's output (plain autograd, no hookrun) cut into windows, then x W^T + b.
    seen = {}
    attn = dict(model.named_modules())[f"{block}.attn"]
    handle = dict(model.named_modules())[f"{block}.norm1"].register_forward_hook(
        lambda m, a, out: seen.setdefault("norm1", out)
    )
    try:
        out = model(torch.stack(xs))
    finally:
        handle.remove()
    windows = _swin_windows(seen["norm1"])  # (3, 4, 49, 96) at 32 px
    qkv = windows @ attn.qkv.weight.T + attn.qkv.bias
    assert data["captures/features.1.0.attn.qkv/output"].shape == (3, 4, 49, 288)
    np.testing.assert_allclose(
        data["captures/features.1.0.attn.qkv/output"], qkv.detach(), rtol=1e-4, atol=1e-5
    )
    # grad_output of qkv against plain autograd: norm1's output feeds only this attention,
    # whose input reaches the target only through qkv, so autograd's gradient at norm1's
    # output is the stored qkv gradient times W, window by window put back, padding cut.
    target = out.gather(1, out.argmax(1)[:, None]).sum()
    (grad,) = torch.autograd.grad(target, seen["norm1"])
    assert grad.abs().max() > 0
    stored = torch.from_numpy(data["captures/features.1.0.attn.qkv/grad_output"])
    back = (stored @ attn.qkv.weight).view(3, 2, 2, 7, 7, 96).permute(0, 1, 3, 2, 4, 5)
    back = back.reshape(3, 14, 14, 96)[:, :8, :8]
    np.testing.assert_allclose(back.detach(), grad, rtol=1e-3, atol=1e-7)


def test_module_named_exactly_that_never_runs_is_refused(tmp_path):
    # A module named exactly that never runs, not even through its weight: refused, never
    # silent (nn.MultiheadAttention's out_proj is reached: tests/runtime/test_row_layouts.py).
    model = WeightUser()
    model.spare = nn.Linear(6, 6)  # registered, never called, its weight never used
    with pytest.raises(HookrunError, match=r"hooks.s.select.name: 'spare' never runs"):
        _run(model, _vectors(), tmp_path, *_hook("s", "output", name="spare"))


def test_function_sites_are_layers_of_the_reader_and_the_pictures(tmp_path):
    overrides = ["experiment=saliency", "render=true", *_hook("g", "output", function="gelu")]
    result = hookrun.run(overrides, model=Functional(), dataset=images(10, n=1), run_dir=tmp_path)
    with result.open() as res:
        assert {"model/gelu.0", "input"} <= set(res.layers)
        assert res.layers["model/gelu.0"]["output"] == (1, 6, 10, 10)
    assert result.images is not None and any(result.images.glob("*.png"))


def test_swin_bulk_capture_stores_every_linear(tmp_path):
    overrides = ["experiment=capture", "render=false", "++hooks.capture.select.type=Linear"]
    result = hookrun.run(overrides, model=family("swin_t"), dataset=images(32), run_dir=tmp_path)
    assert "never ran" not in result.summary
    with result.open() as res:
        assert res.layers["features.1.0.mlp.0"]["output"][0] == 2
        assert res.layers["features.1.0.attn.qkv"]["output"] == (2, 4, 49, 288)
        assert res.layers["features.1.0.attn.proj"]["output"] == (2, 4, 49, 96)
