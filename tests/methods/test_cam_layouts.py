"""Grad-CAM / CAM on every layout a CAM layer has in today's models — channels-first maps
(CNNs), channels-last maps (Swin), tokens with a class token (ViT) — against pytorch-grad-cam's
GradCAM with the reshape transforms its documentation gives for ViT and Swin."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import pytorch_grad_cam.base_cam
import torch
import torchvision
from any_models import family, images
from conftest import read
from pytorch_grad_cam import GradCAM
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
from torch import nn

import hookrun
from hookrun.errors import HookrunError
from hookrun.pipeline.camlayer import pick_cam_layer

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow


def _vit_tokens(tensor: torch.Tensor) -> torch.Tensor:
    """pytorch-grad-cam's ViT reshape: drop the class token, tokens → (N, D, h, w)."""
    side = int((tensor.shape[1] - 1) ** 0.5)
    grid = tensor[:, 1:, :].reshape(tensor.size(0), side, side, tensor.size(2))
    return grid.transpose(2, 3).transpose(1, 2)


def _swin_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.permute(0, 3, 1, 2)


# family → (CAM layer, input size, reshape transform for pytorch-grad-cam, layout found)
CASES = {
    "resnet18": ("layer4", 64, None),
    "mobilenet_v3_small": ("features.12", 64, None),
    "efficientnet_b0": ("features.8", 64, None),
    "convnext_tiny": ("features.7", 64, None),
    # Not features.norm5: DenseNet's forward applies F.relu(inplace=True) to it, which rewrites
    # pytorch-grad-cam's stored activation (hookrun copies the value norm5 produced).
    "densenet121": ("features.denseblock4", 64, None),
    "vit_b_16": ("encoder.layers.encoder_layer_11.ln_1", 64, _vit_tokens),
    "swin_t": ("norm", 64, _swin_channels_last),
}


def _reference(model, layer, x, target, transform, monkeypatch) -> np.ndarray:
    """pytorch-grad-cam's raw map: its min-max scaling and resize switched off."""
    monkeypatch.setattr(pytorch_grad_cam.base_cam, "scale_cam_image", lambda cam, size=None: cam)
    module = dict(model.named_modules())[layer]
    with GradCAM(model=model, target_layers=[module], reshape_transform=transform) as cam:
        return cam(x, targets=[ClassifierOutputTarget(int(t)) for t in target])


def _run(experiment: str, model: nn.Module, xs, tmp_path, *extra: str) -> dict:
    overrides = [f"experiment={experiment}", "render=false", "batch_size=2", *extra]
    return read(hookrun.run(overrides, model=model, dataset=xs, run_dir=tmp_path).path)


@pytest.mark.parametrize("name", list(CASES))
def test_grad_cam_any_layout_equals_pytorch_grad_cam(tmp_path, monkeypatch, name):
    layer, size, transform = CASES[name]
    model = family(name, seed=2)
    if name == "vit_b_16":
        model = family_vit(size)
    reference_model = copy.deepcopy(model)
    xs = images(size)
    data = _run("grad_cam", model, xs, tmp_path, f"model.cam_layer={layer}")
    got = data[f"derived/grad_cam/{layer}"]
    target = data["samples/target"]
    expected = _reference(reference_model, layer, torch.stack(xs), target, transform, monkeypatch)
    assert got.shape == expected.shape and got.shape[1] * got.shape[2] > 1
    scale = np.abs(expected).max()
    assert scale > 0
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)
    # The captures stay exactly as the model produced them (no reshaping in /captures).
    assert data[f"captures/{layer}/output"].shape[1:] == _layer_shape(reference_model, layer, xs)


def family_vit(size: int) -> nn.Module:
    torch.manual_seed(2)
    model = torchvision.models.vit_b_16(weights=None, image_size=size)
    with torch.no_grad():
        model.class_token.normal_(0, 0.5)
        model.heads.head.weight.normal_(0, 0.5)
    return model.eval()


def _layer_shape(model: nn.Module, layer: str, xs) -> tuple:
    seen = {}

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["o"] = output.shape[1:]

    handle = dict(model.named_modules())[layer].register_forward_hook(keep)
    with torch.no_grad():
        model(torch.stack(xs))
    handle.remove()
    return tuple(seen["o"])


def test_cam_on_channels_last_swin_is_the_head_on_each_cell(tmp_path):
    model = family("swin_t", seed=2)
    xs = images(64)
    data = _run("cam", copy.deepcopy(model), xs, tmp_path, "model.cam_layer=norm")
    target = data["samples/target"]
    features = data["captures/norm/output"]  # (N, H, W, C), as Swin produced it
    w = model.head.weight.detach().numpy()[target]  # (N, C)
    expected = np.einsum("nhwc,nc->nhw", features, w)
    np.testing.assert_allclose(data["derived/cam/norm"], expected, rtol=1e-4, atol=1e-5)


class _Square(nn.Module):
    """A layer (`body`, no conv of its own) whose (8, 8, 8) output fits both channels-first
    and channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        self.body = nn.Tanh()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.conv(x)).mean(dim=(2, 3)))


def test_ambiguous_layout_is_refused_and_the_override_decides(tmp_path):
    xs = images(32)
    with pytest.raises(HookrunError, match=r"derive.grad_cam.layout: .*\[8, 8, 8\].*nchw, nhwc"):
        _run("grad_cam", _Square(), xs, tmp_path / "a", "model.cam_layer=body")
    data = _run(
        "grad_cam",
        _Square(),
        xs,
        tmp_path / "b",
        "model.cam_layer=body",
        "++derive.grad_cam.layout=nchw",
    )
    assert data["derived/grad_cam/body"].shape == (2, 8, 8)
    # A conv layer with that channel count decides the tie: channels-first.
    data = _run("grad_cam", _Square(), xs, tmp_path / "c", "model.cam_layer=conv")
    assert data["derived/grad_cam/conv"].shape == (2, 8, 8)


def test_non_spatial_layer_is_refused(tmp_path):
    with pytest.raises(HookrunError, match=r"derive.grad_cam.layout: .*\[3\]"):
        _run("grad_cam", _Square(), images(32), tmp_path, "model.cam_layer=head")


def test_bad_layout_word_lists_the_choices(tmp_path):
    with pytest.raises(HookrunError, match="derive.grad_cam.layout.*nhwc"):
        _run(
            "grad_cam",
            _Square(),
            images(32),
            tmp_path,
            "model.cam_layer=body",
            "++derive.grad_cam.layout=hwc",
        )


@pytest.mark.parametrize(
    "name,expected",
    [
        ("resnet18", "layer4"),
        ("convnext_tiny", "features"),
        ("mobilenet_v3_small", "features"),  # its squeeze-excitation poolings are not the head
        ("vit_b_16", "ln_1"),
    ],
)
def test_auto_cam_layer_is_the_last_map_the_gradient_reaches(name, expected):
    model = family_vit(64) if name == "vit_b_16" else family(name)
    picked = pick_cam_layer(model, images(64)[0])
    # ViT: before the last attention (after it only the class token reaches the head).
    assert picked == ("encoder.layers.encoder_layer_11.ln_1" if name == "vit_b_16" else expected)


def test_auto_cam_layer_end_to_end_on_swin(tmp_path, monkeypatch):
    model = family("swin_t", seed=2)
    reference_model = copy.deepcopy(model)
    xs = images(64)
    data = _run("grad_cam", model, xs, tmp_path, "model.cam_layer=auto")
    (key,) = [k for k in data if k.startswith("derived/grad_cam/")]
    assert key == "derived/grad_cam/permute"  # Swin's channels-first view before avgpool
    target = data["samples/target"]
    expected = _reference(reference_model, "permute", torch.stack(xs), target, None, monkeypatch)
    np.testing.assert_allclose(data[key], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("name", ["vit_b_16", "swin_t"])
@pytest.mark.parametrize("method", ["grad_cam_pp", "layer_cam"])
def test_grad_cam_pp_and_layer_cam_on_tokens_and_channels_last(tmp_path, monkeypatch, name, method):
    """Grad-CAM++ and LayerCAM go through the same layout conversion as Grad-CAM."""
    from pytorch_grad_cam import GradCAMPlusPlus, LayerCAM

    layer, size, transform = CASES[name]
    model = family_vit(size) if name == "vit_b_16" else family(name, seed=2)
    reference_model = copy.deepcopy(model)
    xs = images(size)
    data = _run(method, model, xs, tmp_path, f"model.cam_layer={layer}")
    got = data[f"derived/{method}/{layer}"]
    monkeypatch.setattr(pytorch_grad_cam.base_cam, "scale_cam_image", lambda cam, size=None: cam)
    module = dict(reference_model.named_modules())[layer]
    cls = GradCAMPlusPlus if method == "grad_cam_pp" else LayerCAM
    targets = [ClassifierOutputTarget(int(t)) for t in data["samples/target"]]
    with cls(model=reference_model, target_layers=[module], reshape_transform=transform) as cam:
        expected = cam(torch.stack(xs), targets=targets)
    assert got.shape == expected.shape and np.abs(expected).max() > 0
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())


def test_auto_cam_layer_refuses_a_blind_model():
    # torchvision's own init: ViT's head is zero, so every gradient is zero.
    blind = torchvision.models.vit_b_16(weights=None, image_size=32).eval()
    with pytest.raises(HookrunError, match=r"model.cam_layer: 'auto' .*gradient is zero on all"):
        pick_cam_layer(blind, images(32)[0])
