"""The sanity check (Adebayo et al. 2018) against a cascade written here: the ImageNet
MobileNetV2 on the three photos (112 px), its default layers, saliency and Guided Backprop by
plain autograd; the layers found from other models; independent mode; and the caller's model
given back bit for bit, also when a run fails half-way."""

from __future__ import annotations

import copy
import zlib

import h5py
import numpy as np
import pytest
import torch
import torchvision
from conftest import read, resnet18_file, run_config
from references import input_gradient, mobilenet, swap_relu6
from scipy.stats import spearmanr
from torch import nn

import hookrun
from hookrun.stage import stage_columns
from hookrun.stages.sanity.randomize import default_layers

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

MOBILENET_LAYERS = ["classifier.1", *(f"features.{i}" for i in range(18, -1, -1))]


@pytest.mark.parametrize(
    "name,expected",
    [
        ("mobilenet_v2", MOBILENET_LAYERS),
        ("resnet18", ["fc", "layer4", "layer3", "layer2", "layer1", "bn1", "conv1"]),
        ("vgg11", ["classifier.6", "classifier.3", "classifier.0", "features.18"]),
    ],
)
def test_the_default_layers_are_found_from_the_model(name, expected):
    model = getattr(torchvision.models, name)().eval()
    found = default_layers(model, torch.randn(3, 64, 64))
    assert found[: len(expected)] == expected
    if name == "vgg11":
        assert found[-1] == "features.0" and len(found) == 11  # its 8 convs and 3 linears


def randomised(model: nn.Module, layer: str, seed: int = 0) -> None:
    """The documented redraw: every module inside `layer` by its own reset_parameters() and
    reset_running_stats(), each seeded by (seed, its qualified name)."""
    for name, module in model.get_submodule(layer).named_modules(prefix=layer):
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(f"sanity|{name}".encode())) % 2**63)
        for reset in ("reset_parameters", "reset_running_stats"):
            if hasattr(module, reset):
                getattr(module, reset)()


def spearman_abs(maps: np.ndarray, original: np.ndarray) -> np.ndarray:
    pairs = zip(np.abs(maps).sum(1), np.abs(original).sum(1), strict=True)
    return np.array([spearmanr(a.ravel(), b.ravel())[0] for a, b in pairs])


def test_cascade_equals_a_hand_written_one_and_guided_bp_fails_saliency_passes(tmp_path):
    run = ["experiment=sanity_check", "sanity.methods=[saliency,guided_bp]", "render=false"]
    run += ["dataset.resize=128", "dataset.crop=112", "sanity.keep_maps=false"]
    result = run_config(tmp_path, run)
    data = read(result.path)
    with hookrun.open(result.path) as res:
        assert list(res["sanity"].attrs["layers"]) == MOBILENET_LAYERS
        verdicts = {m: dict(res[f"sanity/{m}"].attrs) for m in ("saliency", "guided_bp")}
    x = torch.from_numpy(data["captures/input/output"])
    target = data["samples/target"]
    model = mobilenet()
    expected = {"saliency": [np.ones(3)], "guided_bp": [np.ones(3)]}
    first = {"saliency": input_gradient(model, x, target)}
    first["guided_bp"] = input_gradient(swap_relu6(copy.deepcopy(model), "guided"), x, target)
    for layer in MOBILENET_LAYERS:  # cascading: each step randomises one more layer
        randomised(model, layer)
        saliency = input_gradient(model, x, target)
        guided = input_gradient(swap_relu6(copy.deepcopy(model), "guided"), x, target)
        expected["saliency"].append(spearman_abs(saliency, first["saliency"]))
        expected["guided_bp"].append(spearman_abs(guided, first["guided_bp"]))
    for method, columns in expected.items():
        got = data[f"sanity/{method}/spearman_abs"]
        assert got.shape == (3, 21)
        np.testing.assert_allclose(got, np.stack(columns, 1), atol=0.1)
        score = np.mean(np.median(got[:, 1:], axis=0))
        assert verdicts[method]["score"] == pytest.approx(score)
    # Adebayo et al.: Guided Backprop hardly changes when the weights go; saliency does.
    assert not verdicts["guided_bp"]["passed"] and verdicts["guided_bp"]["score"] > 0.6
    assert verdicts["saliency"]["passed"] and verdicts["saliency"]["score"] < 0.3
    assert "sanity guided_bp: FAILS" in result.summary
    # A sweep's columns: each method's verdict score, from the file alone.
    with h5py.File(result.path) as f:
        columns = stage_columns(f, result.rows)
    for method in expected:
        score = np.mean(np.median(data[f"sanity/{method}/spearman_abs"][:, 1:], axis=0))
        assert columns[f"sanity:{method}"] == pytest.approx(score)


SMALL = ["sanity.methods=[saliency,grad_cam]", "model.cam_layer=layer3", "sanity.keep_maps=true"]


def test_independent_mode_randomises_one_layer_at_a_time(tmp_path):
    _, overrides = resnet18_file(tmp_path, seed=2)
    run = [*overrides, "experiment=sanity_check", *SMALL]
    both = read(
        run_config(
            tmp_path / "a", [*run, "sanity.mode=independent", "sanity.layers=[fc,layer4]"]
        ).path
    )
    alone = read(run_config(tmp_path / "b", [*run, "sanity.layers=[layer4]"]).path)
    for method in ("saliency", "grad_cam"):
        maps = both[f"sanity/{method}/maps"]
        np.testing.assert_array_equal(maps[:, 2], alone[f"sanity/{method}/maps"][:, 1])
        np.testing.assert_array_equal(maps[:, 0], alone[f"sanity/{method}/maps"][:, 0])
        assert both[f"sanity/{method}/spearman_abs"][:, 0].tolist() == [1.0] * 3


class FailingNet(nn.Module):
    """A small conv net whose forward raises on its `fail_at`-th call with gradients."""

    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += torch.is_grad_enabled()
        if self.calls == self.fail_at:
            raise RuntimeError("boom while randomised")
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("fail_at", [None, 4])
def test_the_callers_model_comes_back_bit_identical(tmp_path, fail_at):
    net = FailingNet(fail_at).train()
    net.bn.running_mean += 0.5  # not what reset_running_stats gives
    before = {k: v.clone() for k, v in net.state_dict().items()}
    flags = [(p.requires_grad, m.training) for m in net.modules() for p in m.parameters(False)]
    run = ["experiment=sanity_check", "dataset=fake", "dataset.size=3", "dataset.image_size=16"]
    run += ["dataset.num_classes=5", "batch_size=2", "render=false", "progress=false"]
    run += ["sanity.methods=[saliency,guided_bp]", "sanity.layers=[fc,bn,conv]"]
    if fail_at is None:
        hookrun.run(run, model=net, run_dir=tmp_path)
    else:
        with pytest.raises(RuntimeError, match="boom"):
            hookrun.run(run, model=net, run_dir=tmp_path)
    after = net.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert flags == [
        (p.requires_grad, m.training) for m in net.modules() for p in m.parameters(False)
    ]
