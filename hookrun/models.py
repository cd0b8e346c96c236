"""Model builders: torchvision classifiers by name, the seeds' hand-set models, the user's own
class; then weights from a torchvision weights name, a state_dict file, or a seeded init."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torchvision
from torch import nn

from hookrun.config import ModelConfig
from hookrun.errors import HookrunError, nearest
from hookrun.imports import import_class

__all__ = ["SeedMLP", "SeedConvNet", "SEED_MODELS", "build_model", "model_label"]


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


SEED_MODELS: dict[str, type[nn.Module]] = {"seed_mlp": SeedMLP, "seed_convnet": SeedConvNet}


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


def _torchvision_state_dict(cfg: ModelConfig) -> dict | None:
    """The state_dict for a torchvision weights name, or None when `weights` is no such name."""
    if cfg._target_ or cfg.name in SEED_MODELS:
        return None
    enum = torchvision.models.get_model_weights(str(cfg.name))
    names = [w.name for w in enum] + ["DEFAULT"]
    if cfg.weights not in names:
        return None
    weights = enum[cfg.weights] if cfg.weights != "DEFAULT" else enum.DEFAULT
    filename = os.path.basename(weights.url)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / filename
    try:
        # torchvision's own loader: reads the hub cache, downloads only when it is missing.
        return weights.get_state_dict(progress=False, check_hash=True)
    except (OSError, RuntimeError) as err:
        raise HookrunError(
            f"model.weights: {cfg.weights} of {cfg.name} needs {filename}, which is not in "
            f"{cached.parent} and could not be downloaded ({type(err).__name__}); put the file "
            f"at {cached} (from {weights.url})"
        ) from None


def _file_state_dict(path: Path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types for a bad file
        raise HookrunError(
            f"model.weights: {path} is not a readable state_dict file ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]})"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]  # a training checkpoint that wraps the weights
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise HookrunError(f"model.weights: {path} holds a {type(obj).__name__}, not a state_dict")
    return obj


def _load(model: nn.Module, state: dict, cfg: ModelConfig) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or wrong:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", wrong)):
            if items:
                more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
                parts.append(f"{label}: {', '.join(items[:3])}{more}")
        raise HookrunError(
            f"model.weights: {cfg.weights} does not fit {model_label(cfg)}; {'; '.join(parts)}"
        )
    model.load_state_dict(state, strict=True)


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model `cfg` names, with its weights loaded (or initialised from `seed`)."""
    torch.manual_seed(seed)  # random init is part of the run's reproducible state
    model = _construct(cfg)
    if cfg.weights is None:
        return model
    state = _torchvision_state_dict(cfg)
    if state is None:
        path = Path(cfg.weights).expanduser()
        if not path.is_file():
            names = []
            if not cfg._target_ and cfg.name not in SEED_MODELS:
                names = [w.name for w in torchvision.models.get_model_weights(str(cfg.name))]
            choices = ", ".join(names + ["DEFAULT"]) if names else "none for this model"
            raise HookrunError(
                f"model.weights: {cfg.weights!r} is neither a file nor a weights name of "
                f"{model_label(cfg)}; valid: a path to a state_dict file, null, or a "
                f"torchvision weights name ({choices})"
            )
        state = _file_state_dict(path)
    _load(model, state, cfg)
    return model
