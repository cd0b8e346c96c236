"""model=torchvision model.name=<any classifier> and model=timm (weights from a local file):
checked before anything loads, and the default experiments on a timm ViT against
independent references (guided autograd Functions, pytorch-grad-cam)."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_grad_cam.base_cam
import torch
from any_models import guided_reference
from conftest import read
from pytorch_grad_cam import GradCAM
from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

import hookrun
from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

timm = pytest.importorskip("timm")


def test_torchvision_preset_takes_any_name_and_inherits_nothing():
    spec = hookrun.compose(["model=torchvision", "model.name=convnext_tiny"])
    assert spec.model.name == "convnext_tiny"
    assert spec.model.weights is None and spec.model.cam_layer == "auto"


def test_unknown_torchvision_name_lists_the_valid_ones():
    with pytest.raises(HookrunError, match=r"model.name: 'convnext_tiniest' .*valid: .*swin_t"):
        hookrun.compose(["model=torchvision", "model.name=convnext_tiniest"])


def test_name_under_another_preset_never_inherits_its_weights():
    # experiment=guided_bp uses model=mobilenet_v2, whose weights are IMAGENET1K_V1.
    with pytest.raises(HookrunError, match=r"model.name: 'resnet18' with the model=mobilenet_v2"):
        hookrun.compose(["experiment=guided_bp", "model.name=resnet18"])


def test_timm_weights_must_be_a_local_file():
    with pytest.raises(HookrunError, match=r"model.weights: 'augreg_in21k' is not a file"):
        hookrun.compose(
            ["model=timm", "model.name=vit_tiny_patch16_224", "model.weights=augreg_in21k"]
        )


def _timm_vit(path) -> torch.nn.Module:
    """A timm ViT (random weights; the class token re-initialised: timm's is ~1e-6) saved
    as a state_dict, as a user brings weights to a machine without network."""
    torch.manual_seed(12)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10)
    with torch.no_grad():
        model.cls_token.normal_(0, 0.5)
        model.head.weight.normal_(0, 0.5)
    torch.save(model.state_dict(), path)
    return model.eval()


TIMM = ["model=timm", "model.name=vit_tiny_patch16_224", "+model.kwargs.img_size=32"]
TIMM += ["+model.kwargs.num_classes=10", "dataset=fake", "dataset.size=2"]
TIMM += ["dataset.image_size=32", "render=false"]


def test_timm_vit_guided_bp_and_grad_cam_equal_the_references(tmp_path, monkeypatch):
    weights = tmp_path / "vit.pt"
    reference = _timm_vit(weights)
    common = [*TIMM, f"model.weights={weights}"]
    guided = read(hookrun.run(["experiment=guided_bp", *common], run_dir=tmp_path / "g").path)
    x = torch.from_numpy(guided["captures/input/output"])
    target = torch.from_numpy(guided["samples/target"])
    expected = guided_reference(_timm_vit(tmp_path / "copy.pt"), x, target).numpy()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(
        guided["captures/input/grad_output"], expected, rtol=1e-4, atol=1e-4 * scale
    )

    cam = read(hookrun.run(["experiment=grad_cam", *common], run_dir=tmp_path / "c").path)
    (key,) = [k for k in cam if k.startswith("derived/grad_cam/")]
    assert key == "derived/grad_cam/blocks.11.norm1"  # cam_layer auto: before the last attention
    monkeypatch.setattr(pytorch_grad_cam.base_cam, "scale_cam_image", lambda c, size=None: c)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # pytorch-grad-cam's ViT reshape transform
        return t[:, 1:, :].reshape(t.size(0), 2, 2, t.size(2)).permute(0, 3, 1, 2)

    with GradCAM(reference, [reference.blocks[11].norm1], reshape_transform=tokens) as grad_cam:
        ref = grad_cam(x, [ClassifierOutputTarget(int(t)) for t in cam["samples/target"]])
    np.testing.assert_allclose(cam[key], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
