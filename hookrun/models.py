"""Model builders: torchvision classifiers by name, the seeds' hand-set models, the user's own
class; then weights from a torchvision weights name, a state_dict file, or a seeded init."""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision
from torch import nn

from hookrun.config import ModelConfig
from hookrun.errors import HookrunError, nearest
from hookrun.imports import import_class
from hookrun.weights import load_weights

__all__ = [
    "SeedMLP",
    "SeedConvNet",
    "DigitsCNN",
    "SEED_MODELS",
    "build_model",
    "class_names",
    "model_label",
]


class SeedMLP(nn.Module):
    """The MLP of ../shared/seeds/000 with its hand-set weights (input: 3 numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc1.weight.copy_(
                torch.tensor([[1.0, 2, 3], [-4, -5, -6], [7, 8, 9], [-10, -11, -12]])
            )
            self.fc1.bias.copy_(torch.tensor([1.0, 2, 3, 4]))
            self.fc2.weight.copy_(torch.tensor([[1.0, 2, 3, 4]]))
            self.fc2.bias.copy_(torch.tensor([1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu1(self.fc1(x)))


class SeedConvNet(nn.Module):
    """The conv net of ../shared/seeds/001-002: kernels of ones and twos, then 2x2 max pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3)
        self.pool1 = nn.MaxPool2d(2, 2)
        with torch.no_grad():
            self.conv1.weight[0].fill_(1.0)
            self.conv1.weight[1].fill_(2.0)
            self.conv1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool1(self.conv1(x))


class DigitsCNN(nn.Module):
    """A small CNN for scikit-learn's 8x8 digits; ends in global average pooling + one
    linear layer, so CAM applies. Trained by scripts/train_digits.py."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


SEED_MODELS: dict[str, type[nn.Module]] = {
    "seed_mlp": SeedMLP,
    "seed_convnet": SeedConvNet,
    "digits_cnn": DigitsCNN,
}


def class_names(cfg: ModelConfig) -> list[str] | None:
    """Names of the model's output classes, where known (ImageNet weights, digits)."""
    if cfg.name == "digits_cnn":
        return [str(d) for d in range(10)]
    if cfg._target_ or cfg.name in SEED_MODELS or not cfg.weights:
        return None
    try:
        enum = torchvision.models.get_model_weights(str(cfg.name))
        weights = enum.DEFAULT if cfg.weights == "DEFAULT" else enum[cfg.weights]
    except (KeyError, ValueError):
        return None  # weights from a file: the classes are the user's
    return list(weights.meta.get("categories") or []) or None


def model_label(cfg: ModelConfig) -> str:
    """How messages name the model."""
    return cfg._target_ or cfg.name or "?"


def _torchvision_names() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _construct(cfg: ModelConfig) -> nn.Module:
    if cfg._target_:
        cls = import_class(cfg._target_, "model._target_", nn.Module)
        try:
            return cls(**cfg.kwargs)
        except TypeError as err:
            raise HookrunError(
                f"model.kwargs: {cfg._target_}({cfg.kwargs}) failed: {err}"
            ) from None
    name = str(cfg.name)
    if name in SEED_MODELS:
        if cfg.kwargs:
            raise HookrunError(f"model.kwargs: {name} takes no arguments, got {cfg.kwargs}")
        return SEED_MODELS[name]()
    known = _torchvision_names()
    if name not in known:
        hint = ", ".join(nearest(name, known + list(SEED_MODELS))) or ", ".join(SEED_MODELS)
        raise HookrunError(
            f"model.name: {name!r} is not a torchvision classification model or seed model; "
            f"nearest: {hint} (all: torchvision.models.list_models())"
        )
    try:
        return torchvision.models.get_model(name, weights=None, **cfg.kwargs)
    except (TypeError, ValueError) as err:
        raise HookrunError(f"model.kwargs: {name}({cfg.kwargs}) failed: {err}") from None


def build_model(
    cfg: ModelConfig, seed: int, weights_path: list[str] | None = None
) -> tuple[nn.Module, Path | None]:
    """The model `cfg` names with its weights loaded (or initialised from `seed`), and the
    file the weights came from (None for random init)."""
    torch.manual_seed(seed)  # random init is part of the run's reproducible state
    model = _construct(cfg)
    if cfg.weights is None:
        return model, None
    tv_name = None if (cfg._target_ or cfg.name in SEED_MODELS) else str(cfg.name)
    return model, load_weights(model, cfg.weights, model_label(cfg), tv_name, weights_path or [])
