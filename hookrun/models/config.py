"""The `model:` config node, merged into this dataclass and checked by the model's source
(models/sources.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookrun.typed import Frozen

__all__ = ["ModelConfig"]


@dataclass
class ModelConfig(Frozen):
    source: str | None = None
    """Where the model comes from (hookrun/models/sources.py): torchvision, timm, seed, custom;
    null picks custom when `_target_` is set, seed for the seed models, else torchvision.
    """
    name: str | None = None
    """A torchvision classification model name (`resnet18`, ...) or a seed model (`seed_mlp`,
    `seed_convnet`, `digits_cnn`); ignored when `_target_` is set.
    """
    _target_: str | None = None
    """Dotted path of the user's own nn.Module class; built with `kwargs`."""
    weights: str | None = None
    """A torchvision weights name (IMAGENET1K_V1, DEFAULT), a path to a state_dict file, or null
    for random init (seeded by the top-level `seed`).
    """
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model's constructor, e.g. {num_classes: 10}."""
    preset: str | None = None
    """The model a named preset (model=resnet18, ...) is for: model.name=X with another preset
    would inherit that preset's weights, so it is refused (use model=torchvision).
    """
    cam_layer: str | None = "auto"
    """The layer CAM / Grad-CAM read (the last feature maps); `auto`: picked by a probe of one
    sample (hookrun/pipeline/camlayer.py), the run log says which.
    """
    path: str | None = None
    """model.source=hf (hookrun/models/hf.py): a folder written by save_pretrained (read offline),
    or a transformers config for a random init (seeded), e.g. {model_type: gpt2, n_layer: 2};
    `tokenizer` a tokenizer folder (null: model.path's, or for `config` a byte-level tokenizer
    made from no files).
    """
    config: dict[str, Any] | None = None
    """model.source=hf: a transformers config for a randomly initialised model (seeded), e.g.
    {model_type: gpt2, n_layer: 2}, instead of `path`.
    """
    tokenizer: str | None = None
    """model.source=hf: a tokenizer folder; null: model.path's, or for `config` a byte-level
    tokenizer made from no files.
    """
    class_: str = "causal_lm"
    """`model.class` in the config (a Python keyword, so `class_` here): causal_lm | masked_lm |
    base | sequence_classification.
    """
    dtype: str = "float32"
    """float32 | bfloat16 | float16"""
    attention: str = "eager"
    """eager | sdpa: the attention implementation (hookrun/models/hf.py says which to pick)."""
    trust_remote_code: bool = False
    """Run Python code a model folder ships (auto_map); refused unless true."""
    device_map: Any = None
    """A model spread over devices, the CPU and disk, through Accelerate (models/placement.py):
    auto | balanced | balanced_low_0 | sequential, or {module name: cuda:N | cpu | disk};
    max_memory {device: bytes, e.g. 10GiB}; offload_folder for the weights put on disk.
    """
    max_memory: Any = None
    """With `device_map`: what each device may hold, {device: bytes or '10GiB'}."""
    offload_folder: str | None = None
    """With `device_map`: where the weights the map puts on disk are kept."""
