"""Model sources: where `model:` gets its nn.Module — torchvision or timm by name, the seed
models, the user's own class, or a Hugging Face transformers model (`hf`, hookrun/models/hf.py).
One registration each (`@_source(name)`); `model.source` picks one (null: `custom` when
`_target_` is set, `seed` for a seed model's name, else `torchvision`).
Weights then come from a torchvision weights name, a state_dict file, or a seeded init.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookrun.errors import HookrunError, nearest
from hookrun.extras import missing_extra
from hookrun.models import hf
from hookrun.models.config import ModelConfig
from hookrun.models.seeds import SEED_MODELS
from hookrun.models.weights import load_weights
from hookrun.registry import Registry
from hookrun.typed import import_class, parse_typed

__all__ = [
    "ModelSource",
    "MODEL_SOURCES",
    "BuiltModel",
    "parse_model",
    "source_of",
    "check_model",
    "build_model",
    "class_names",
    "model_label",
]


def _vision_models() -> Any:
    """torchvision.models, imported when a torchvision model is asked for (about 1 s that a
    language-model run never pays)."""
    import torchvision.models

    return torchvision.models


@dataclass(frozen=True)
class BuiltModel:
    """A model with its weights, the file they came from (None for random init), and
    whether random init deserves a warning."""

    module: nn.Module
    weights_file: Path | None
    random_warning: bool


class ModelSource:
    """How one source checks, builds and names its models."""

    # Whether model.name or model._target_ names the model (hf: model.path / model.config).
    named = True

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a config this source cannot build, before anything loads."""

    def construct(self, cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    def weights_names(self, cfg: ModelConfig) -> list[str]:
        """Weights names (besides files) `model.weights` may take for this model."""
        return []

    def class_names(self, cfg: ModelConfig) -> list[str] | None:
        """Names of the output classes, where known."""
        return None

    def warns_random(self, cfg: ModelConfig) -> bool:
        """Whether random init is worth a warning (real architectures, not hand-set ones)."""
        return True

    def build(self, cfg: ModelConfig, weights_path: tuple[str, ...]) -> BuiltModel:
        """The model with its weights (torch's generator is seeded already)."""
        model = self.construct(cfg)
        if cfg.weights is None:
            return BuiltModel(model, None, self.warns_random(cfg))
        tv_name = str(cfg.name) if self.weights_names(cfg) else None
        path = load_weights(model, cfg.weights, model_label(cfg), tv_name, list(weights_path))
        return BuiltModel(model, path, False)


MODEL_SOURCES: Registry[ModelSource] = Registry("a model source")


def _source(name: str):
    def add(cls: type[ModelSource]) -> type[ModelSource]:
        MODEL_SOURCES.register(name)(cls())
        return cls

    return add


@_source("torchvision")
class _Torchvision(ModelSource):
    def check(self, cfg: ModelConfig) -> None:
        known = sorted(_vision_models().list_models(module=_vision_models()))
        if not cfg.name or cfg.name not in known:
            hint = ", ".join(nearest(str(cfg.name), known + list(SEED_MODELS)))
            raise HookrunError(
                f"model.name: {cfg.name!r} is not a torchvision classification model or seed "
                f"model; nearest: {hint or ', '.join(SEED_MODELS)}; valid: "
                f"{', '.join(known)}, {', '.join(SEED_MODELS)}"
            )

    def construct(self, cfg: ModelConfig) -> nn.Module:
        try:
            return _vision_models().get_model(str(cfg.name), weights=None, **cfg.kwargs)
        except (TypeError, ValueError) as err:
            raise HookrunError(
                f"model.kwargs: {cfg.name}({dict(cfg.kwargs)}) failed: {err}"
            ) from None

    def weights_names(self, cfg: ModelConfig) -> list[str]:
        enum = _vision_models().get_model_weights(str(cfg.name))
        return [w.name for w in enum] + ["DEFAULT"]

    def class_names(self, cfg: ModelConfig) -> list[str] | None:
        if not cfg.weights:
            return None
        try:
            enum = _vision_models().get_model_weights(str(cfg.name))
            weights = enum.DEFAULT if cfg.weights == "DEFAULT" else enum[cfg.weights]
        except (KeyError, ValueError):
            return None  # weights from a file: the classes are the user's
        return list(weights.meta.get("categories") or []) or None


def _timm():
    try:
        import timm  # an optional extra: pip install hookrun[timm]
    except ImportError:
        raise missing_extra("model.source: 'timm'", "timm", "model=torchvision") from None
    return timm


@_source("timm")
class _Timm(ModelSource):
    def check(self, cfg: ModelConfig) -> None:
        known = _timm().list_models()
        if not cfg.name or cfg.name not in known:
            hint = ", ".join(nearest(str(cfg.name), known, n=8))
            raise HookrunError(
                f"model.name: {cfg.name!r} is not a timm model; nearest: {hint or 'none'} "
                "(all: timm.list_models())"
            )
        if cfg.weights is not None and not Path(cfg.weights).expanduser().is_file():
            raise HookrunError(
                f"model.weights: {cfg.weights!r} is not a file; valid: a local state_dict file "
                "(nothing is downloaded at run time) or null"
            )

    def construct(self, cfg: ModelConfig) -> nn.Module:
        try:
            return _timm().create_model(str(cfg.name), pretrained=False, **cfg.kwargs)
        except (TypeError, ValueError) as err:
            raise HookrunError(
                f"model.kwargs: {cfg.name}({dict(cfg.kwargs)}) failed: {err}"
            ) from None


@_source("seed")
class _Seed(ModelSource):
    def check(self, cfg: ModelConfig) -> None:
        if cfg.name not in SEED_MODELS:
            raise HookrunError(
                f"model.name: {cfg.name!r} is not a seed model; valid: {', '.join(SEED_MODELS)}"
            )
        if cfg.kwargs:
            raise HookrunError(
                f"model.kwargs: {cfg.name} takes no arguments, got {dict(cfg.kwargs)}"
            )

    def construct(self, cfg: ModelConfig) -> nn.Module:
        return SEED_MODELS[str(cfg.name)]()

    def class_names(self, cfg: ModelConfig) -> list[str] | None:
        return [str(d) for d in range(10)] if cfg.name == "digits_cnn" else None

    def warns_random(self, cfg: ModelConfig) -> bool:
        return False  # hand-set weights


@_source("custom")
class _Custom(ModelSource):
    def check(self, cfg: ModelConfig) -> None:
        if not cfg._target_:
            raise HookrunError(
                "model._target_: null; model.source=custom needs a dotted class path"
            )
        import_class(cfg._target_, "model._target_", nn.Module)

    def construct(self, cfg: ModelConfig) -> nn.Module:
        cls = import_class(str(cfg._target_), "model._target_", nn.Module)
        try:
            return cls(**cfg.kwargs)
        except TypeError as err:
            raise HookrunError(
                f"model.kwargs: {cfg._target_}({dict(cfg.kwargs)}) failed: {err}"
            ) from None


@_source("hf")
class _HuggingFace(ModelSource):
    named = False

    def check(self, cfg: ModelConfig) -> None:
        hf.check_hf(cfg)

    def build(self, cfg: ModelConfig, weights_path: tuple[str, ...]) -> BuiltModel:
        model, path = hf.build_hf(cfg)
        return BuiltModel(model, path, False)  # model.config: a random init by request


# The keys only model.source=hf reads, with their defaults.
_HF_KEYS = {
    "path": None,
    "config": None,
    "tokenizer": None,
    "class_": "causal_lm",
    "dtype": "float32",
    "attention": "eager",
    "trust_remote_code": False,
    "device_map": None,
    "max_memory": None,
    "offload_folder": None,
}
_CLASS = re.compile(r"\bclass_\b")


def parse_model(node: Any) -> ModelConfig:
    """The `model:` node as a ModelConfig; the user's key `class` is the field `class_`
    (a Python keyword), and errors name it `model.class`."""
    raw = dict(node or {})
    if "class_" in raw:
        raise HookrunError("model.class_: unknown key (did you mean 'class'?)")
    if "class" in raw:
        raw["class_"] = raw.pop("class")
    try:
        return parse_typed(raw, ModelConfig, "model")
    except HookrunError as err:
        raise HookrunError(_CLASS.sub("class", str(err))) from None


def source_of(cfg: ModelConfig) -> ModelSource:
    """The source `cfg` names, or the one its other keys imply."""
    if cfg.source is not None:
        return MODEL_SOURCES.get(cfg.source, "model.source")
    if cfg._target_:
        return MODEL_SOURCES.get("custom", "model.source")
    if cfg.name in SEED_MODELS:
        return MODEL_SOURCES.get("seed", "model.source")
    return MODEL_SOURCES.get("torchvision", "model.source")


def check_model(cfg: ModelConfig) -> None:
    """Everything about `model:` that can be checked before building it."""
    source = source_of(cfg)
    if not source.named:
        source.check(cfg)
        return
    for key, default in _HF_KEYS.items():
        if getattr(cfg, key) != default:
            raise HookrunError(
                f"model.{key.rstrip('_')}: {getattr(cfg, key)!r} is read by model.source=hf "
                f"only; valid: model=hf, or {default!r} with model.source={cfg.source or 'null'}"
            )
    if not cfg.name and not cfg._target_:
        raise HookrunError(
            "model.name: null; set model.name (e.g. model=torchvision model.name=resnet18) or "
            "model._target_"
        )
    source.check(cfg)
    if cfg.preset and cfg.name != cfg.preset and cfg.weights is not None:
        raise HookrunError(
            f"model.name: {cfg.name!r} with the model={cfg.preset} preset would load that "
            f"preset's weights ({cfg.weights!r}); valid: model=torchvision model.name={cfg.name} "
            f"(weights null unless you set model.weights), or model.weights=null"
        )


def class_names(cfg: ModelConfig) -> list[str] | None:
    """Names of the model's output classes, where known (ImageNet weights, digits)."""
    return source_of(cfg).class_names(cfg)


def model_label(cfg: ModelConfig) -> str:
    """How messages name the model."""
    if cfg.source == "hf":
        given = cfg.config.get("model_type", "?") if cfg.config is not None else "?"
        return cfg.path or f"a random-init {given} ({cfg.class_})"
    return cfg._target_ or cfg.name or "?"


def build_model(cfg: ModelConfig, seed: int, weights_path: tuple[str, ...] = ()) -> BuiltModel:
    """The model `cfg` names with its weights loaded (or initialised from `seed`)."""
    source = source_of(cfg)
    torch.manual_seed(seed)  # random init is part of the run's reproducible state
    return source.build(cfg, tuple(weights_path))


@_source("python")
class _Caller(ModelSource):
    """A model object handed to `hookrun.run(model=...)`; recorded, never built from config."""

    def check(self, cfg: ModelConfig) -> None:
        raise HookrunError(
            "model.source: 'python' names a model object given to hookrun.run(model=...); "
            f"valid in a config: {', '.join(n for n in MODEL_SOURCES if n != 'python')}"
        )
