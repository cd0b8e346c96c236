"""experiment=guided_bp on every rectifier (modules of 13 kinds, torchvision families with
GELU / SiLU / Hardswish) against an independent reference: autograd with each activation
replaced by a Function whose backward is the activation's own gradient clamped at zero."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from any_models import (
    FAMILIES,
    AllRectifiers,
    Functional,
    family,
    guided_call,
    guided_reference,
    images,
    plain_gradient,
)
from conftest import read
from torch import nn

import hookrun
from hookrun.errors import HookrunError

# Each test here runs hookrun (through a module fixture or itself): not the inner loop.
pytestmark = pytest.mark.slow

BASE = ["experiment=guided_bp", "render=false", "batch_size=2"]


def _guided(model: nn.Module, x: list[torch.Tensor], tmp_path) -> dict[str, np.ndarray]:
    result = hookrun.run(BASE, model=model, dataset=x, run_dir=tmp_path)
    return read(result.path)


def _check(model: nn.Module, xs: list[torch.Tensor], tmp_path) -> None:
    reference_model = copy.deepcopy(model)
    data = _guided(model, xs, tmp_path)
    x = torch.stack(xs)
    target = torch.from_numpy(data["samples/target"])
    expected = guided_reference(reference_model, x, target).numpy()
    got = data["captures/input/grad_output"]
    scale = np.abs(expected).max()
    assert scale > 0
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)
    plain = plain_gradient(copy.deepcopy(model), x, target).numpy()
    assert not np.allclose(got, plain, atol=1e-3 * scale)  # the rule changed something


def test_every_rectifier_module_guided(tmp_path):
    torch.manual_seed(3)
    _check(AllRectifiers(), images(12), tmp_path)


# DenseNet also calls F.relu in forward: test_densenet_final_functional_relu_is_guided.
@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "densenet121"])
def test_torchvision_family_guided(tmp_path, name):
    _check(family(name), images(FAMILIES[name][1]), tmp_path)


def test_guided_selection_on_no_rectifier_is_refused(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Sigmoid(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.zeros(1, 3, 8, 8))
    with pytest.raises(HookrunError, match="hooks.guided_relu.select"):
        _guided(model, images(8), tmp_path)


class _Unused(nn.Module):
    """A ReLU module that is registered but never called: clamping it would act on nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.act = nn.ReLU()
        self.fc = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.sigmoid(self.conv(x)).mean(dim=(2, 3)))


def test_guided_selection_that_never_runs_is_refused(tmp_path):
    with pytest.raises(
        HookrunError, match=r"hooks.guided_relu.select: every matched module \(act\)"
    ):
        _guided(_Unused(), images(8), tmp_path)


def test_functional_activations_guided_in_every_spelling(tmp_path):
    xs = images(10)
    data = _guided(Functional(), xs, tmp_path)
    x = torch.stack(xs)
    target = torch.from_numpy(data["samples/target"])
    expected = plain_gradient(Functional(guided=True), x, target).numpy()
    got = data["captures/input/grad_output"]
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)
    assert not np.allclose(got, plain_gradient(Functional(), x, target).numpy(), atol=1e-3 * scale)


def test_densenet_final_functional_relu_is_guided(tmp_path, monkeypatch):
    import torchvision.models.densenet as densenet

    model = family("densenet121")
    reference_model = copy.deepcopy(model)
    xs = images(32)
    data = _guided(model, xs, tmp_path)
    x = torch.stack(xs)
    target = torch.from_numpy(data["samples/target"])
    # DenseNet.forward calls F.relu(features, inplace=True): the reference guides that too.
    guided_f = SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    guided_f.relu = lambda t, inplace=False: guided_call(torch.relu, t)
    monkeypatch.setattr(densenet, "F", guided_f)
    expected = guided_reference(reference_model, x, target).numpy()
    got = data["captures/input/grad_output"]
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)


class _ModeWatcher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.fc = nn.Linear(2, 3)
        self.modes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(torch._C._len_torch_function_stack())
        return self.fc(F.relu(self.conv(x)).mean(dim=(2, 3)))


def test_function_mode_only_with_function_selectors_and_only_in_forward(tmp_path):
    plain = _ModeWatcher()
    hookrun.run(
        ["experiment=saliency", "render=false"],
        model=plain,
        dataset=images(8),
        run_dir=tmp_path / "a",
    )
    assert plain.modes and not any(plain.modes)  # zero cost: no mode without a function selector
    guided = _ModeWatcher()
    _guided(guided, images(8), tmp_path / "b")
    assert guided.modes[-1] == 1  # the batches' forward passes run under the mode
    assert torch._C._len_torch_function_stack() == 0  # and it is gone after the run
