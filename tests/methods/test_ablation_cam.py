"""Ablation-CAM runs only what follows the CAM layer per ablated channel, from the layer's
output the hooked pass captured, where that can be decided (stages/derive/after_layer.py),
and the whole model with the layer's output replaced where it cannot; both equal
pytorch-grad-cam's AblationCAM. What runs is counted: the rows each part of a caller's model
(with hooks of the caller's own, which a run keeps) sees during the run."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torchvision
from test_perturbation import _grad_cam_library_map
from torch import nn

import hookrun
from hookrun.stages.derive.after_layer import rest_after

RUN = [
    "experiment=ablation_cam",
    "dataset=fake",
    "dataset.size=3",
    "dataset.image_size=32",
    "dataset.num_classes=10",
    "batch_size=2",
    "target.kind=predicted",
    "render=false",
    "progress=false",
]


def _counted(model: nn.Module, names: list[str]) -> dict[str, list[int]]:
    """The batch size of every call of each named module, from now on."""
    seen: dict[str, list[int]] = {name: [] for name in names}
    modules = dict(model.named_modules())
    for name in names:
        modules[name].register_forward_hook(
            lambda m, a, o, name=name: seen[name].append(int(a[0].shape[0]))
        )
    return seen


def _resnet() -> nn.Module:
    torch.manual_seed(3)
    return torchvision.models.resnet18(num_classes=10).eval()


def _run(tmp_path, model: nn.Module, layer: str) -> tuple[np.ndarray, dict, torch.Tensor]:
    result = hookrun.run([*RUN, f"model.cam_layer={layer}"], model=model, run_dir=tmp_path)
    with result.open() as res:
        got = np.asarray(res[f"derived/ablation_cam/{layer}"])
        x = torch.from_numpy(np.asarray(res["captures/input/output"]))
        target = torch.from_numpy(np.asarray(res["samples/target"]))
    return got, x, target


def test_only_what_follows_the_layer_runs_for_each_channel(tmp_path):
    model = _resnet()
    seen = _counted(model, ["conv1", "layer3", "layer4.1.conv2", "fc"])
    got, x, target = _run(tmp_path, model, "layer3")
    # Before the layer: the probes of one sample and the hooked pass of each batch, a row
    # each — never a row per channel (layer3 has 256: 768 ablated rows for 3 images).
    assert sum(seen["conv1"]) <= 3 + 6, seen["conv1"]
    assert seen["layer3"] == seen["conv1"]  # the layer itself runs no more than that
    for after in ("layer4.1.conv2", "fc"):  # what follows: each channel of each row, ablated
        assert sum(seen[after]) >= 256 * 3 + sum(seen["conv1"]), (after, seen[after])
    reference = _resnet()
    want = _grad_cam_library_map("ablation_cam", reference, reference.layer3, x, target)
    assert got.shape == (3, 2, 2)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


class _Skip(nn.Module):
    """A conv net whose CAM layer (`block`, a ReLU's output: pytorch-grad-cam ablates it to
    0 too) has a shortcut around it from the stem, computed before it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, stride=4, padding=1), nn.ReLU())
        self.down = nn.AvgPool2d(4)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        return self.fc((self.block(s) + self.down(s)).mean((2, 3)))


def test_a_layer_with_a_shortcut_around_it_runs_the_whole_model(tmp_path, caplog):
    """The stem's output joins after `block`: the rest cannot be cut off from it, so each
    pass runs the model with the layer's output replaced, many channels a pass."""
    model = _Skip().eval()
    seen = _counted(model, ["stem"])
    with caplog.at_level(logging.WARNING, logger="hookrun"):
        got, x, target = _run(tmp_path, model, "block")
    said = [r.getMessage() for r in caplog.records if "derive.ablation_cam" in r.getMessage()]
    assert said and "computed before 'block', joins the model's output after it" in said[0]
    assert sum(seen["stem"]) >= 8 * 3  # the whole model, once per channel per row
    reference = _Skip().eval()
    want = _grad_cam_library_map("ablation_cam", reference, reference.block, x, target)
    assert got.shape == (3, 8, 8)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


class _Branches(nn.Module):
    """A conv net whose layer `mid` is followed by what the test asks for."""

    def __init__(self, after: str) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)
        self.after = after

    def forward(self, x: torch.Tensor):
        s = self.stem(x)
        m = self.mid(s)
        if self.after == "residual":
            m = m + s
        if self.after == "twice":
            m = self.mid(m)
        if self.after == "branch" and m.sum() > 0:  # control flow on a value
            m = -m
        out = self.head(m.mean((2, 3)))
        if self.after == "batch":
            out = out.reshape(x.shape[0], -1)
        if self.after == "features":
            return out, s
        return out


@pytest.mark.parametrize(
    ("after", "why"),
    [
        ("chain", ""),
        ("residual", "'stem', computed before 'mid', joins the model's output after it"),
        ("batch", "computed before 'mid', joins the model's output after it"),
        ("features", "'stem', computed before 'mid', joins the model's output after it"),
        ("twice", "'mid' is called 2 times in a forward pass"),
        ("branch", "torch.fx cannot trace the model (TraceError"),
    ],
)
def test_the_rest_after_a_layer_is_cut_only_where_nothing_before_joins_it(after, why):
    torch.manual_seed(0)
    model = _Branches(after).eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        activation = model.mid(model.stem(x))
        logits = model(x)
    rest = rest_after(model, "mid", activation, logits)
    if not why:
        assert rest.module is not None and rest.why == ""
        ablated = activation.clone()
        ablated[:, 1] = 0
        with torch.no_grad():
            want = model.head(ablated.mean((2, 3)))
            np.testing.assert_allclose(rest.module(ablated), want, rtol=1e-6)
        return
    assert rest.module is None
    assert why in rest.why, rest.why
