"""Shared by the any-model tests: torchvision families with parameters that default init
leaves blind re-initialised, and small custom models with every rectifier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

RECTIFIERS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.Softplus,
)  # fmt: skip

# family → (constructor kwargs, input size)
FAMILIES = {
    "resnet18": ({}, 32),
    "mobilenet_v3_small": ({}, 32),
    "efficientnet_b0": ({}, 32),
    "convnext_tiny": ({}, 32),
    "densenet121": ({}, 32),
    "vit_b_16": ({"image_size": 32}, 32),
    "swin_t": ({}, 32),
}


def family(name: str, seed: int = 0) -> nn.Module:
    """A torchvision classifier, random weights, nothing left at a blind value: ViT's head and
    class token are zero and ConvNeXt's layer_scale 1e-6 under torchvision's init, which
    makes every gradient 0 or the plain one."""
    kwargs, _ = FAMILIES[name]
    torch.manual_seed(seed)
    model = torchvision.models.get_model(name, weights=None, **kwargs)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "layer_scale" in pname:
                p.uniform_(0.5, 1.5)
            elif pname in ("class_token", "heads.head.weight"):
                p.normal_(0, 0.5)
    return model.eval()


def images(size: int, n: int = 2, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, size, size, generator=g) for _ in range(n)]


class _GuidedFunction(torch.autograd.Function):
    """Any activation whose backward is its own gradient, then clamped at zero."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.module = module
        return module(x.clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            out = ctx.module(leaf.clone())
            (plain,) = torch.autograd.grad(out, leaf, grad)
        return plain.clamp(min=0), None


class _Guided(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GuidedFunction.apply(x, self.inner)


def guided_reference(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The input gradient of each sample's `target` logit with every rectifier module replaced
    by the guided Function (an independent Guided Backprop: plain autograd elsewhere)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, RECTIFIERS):
                setattr(parent, name, _Guided(child))
    return plain_gradient(model, x, target)


def plain_gradient(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.gather(1, target[:, None]).sum().backward()
    return x.grad


class AllRectifiers(nn.Module):
    """A small conv net with every rectifier as a module, in-place forms included."""

    def __init__(self) -> None:
        super().__init__()
        acts = [
            nn.ReLU(inplace=True), nn.ReLU6(), nn.LeakyReLU(0.1, inplace=True), nn.PReLU(4),
            nn.RReLU(), nn.ELU(inplace=True), nn.SELU(), nn.CELU(0.5), nn.GELU("tanh"),
            nn.SiLU(inplace=True), nn.Mish(), nn.Hardswish(inplace=True), nn.Softplus(beta=2),
        ]  # fmt: skip
        layers: list[nn.Module] = [nn.Conv2d(3, 4, 3, padding=1)]
        for act in acts:
            layers += [act, nn.Conv2d(4, 4, 3, padding=1)]
        self.features = nn.Sequential(*layers)
        self.gate = nn.Sequential(nn.Sigmoid())  # a gate: keeps its normal gradient
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = x * self.gate(x)
        return self.fc(self.pool(x).flatten(1))


def guided_call(fn, x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` whose backward is fn's own gradient clamped at zero (the reference rule)."""
    return _GuidedFunction.apply(x, fn)


class Functional(nn.Module):
    """Activations called as functions in every spelling, in-place forms included, and a
    sigmoid gate; `guided=True` is the independent reference (guided Functions instead)."""

    def __init__(self, guided: bool = False) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else 6, 6, 3, padding=1) for i in range(9))
        self.fc = nn.Linear(6, 4)
        self.guided = guided

    def _act(self, fn, x: torch.Tensor, *plain) -> torch.Tensor:
        return guided_call(fn, x) if self.guided else plain[0](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.convs
        x = self._act(torch.relu, c[0](x), lambda t: F.relu(t))
        x = self._act(torch.relu, c[1](x), torch.relu)
        x = self._act(torch.relu, c[2](x), lambda t: t.relu_())
        x = self._act(torch.relu, c[3](x), lambda t: F.relu(t, inplace=True))
        x = self._act(F.gelu, c[4](x), F.gelu)
        x = self._act(F.silu, c[5](x), lambda t: F.silu(t, inplace=True))
        x = self._act(F.hardswish, c[6](x), F.hardswish)
        leaky = lambda t: F.leaky_relu(t, 0.2)  # noqa: E731
        x = self._act(leaky, c[7](x), lambda t: F.leaky_relu(t, 0.2, inplace=True))
        x = c[8](x)
        x = x * torch.sigmoid(x)  # a gate, keeps its normal gradient
        return self.fc(self._act(F.elu, x, F.elu).mean(dim=(2, 3)))
