"""The `model:` config node, merged into this dataclass and checked by the model's source
(models/sources.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookrun.typed import Frozen

__all__ = ["ModelConfig"]


@dataclass
class ModelConfig(Frozen):
    # Where the model comes from (hookrun/models/sources.py): torchvision, timm, seed, custom;
    # null picks custom when `_target_` is set, seed for the seed models, else torchvision.
    source: str | None = None
    # A torchvision classification model name (`resnet18`, ...) or a seed model
    # (`seed_mlp`, `seed_convnet`, `digits_cnn`); ignored when `_target_` is set.
    name: str | None = None
    # Dotted path of the user's own nn.Module class; built with `kwargs`.
    _target_: str | None = None
    # A torchvision weights name (IMAGENET1K_V1, DEFAULT), a path to a state_dict file,
    # or null for random init (seeded by the top-level `seed`).
    weights: str | None = None
    # Keyword arguments for the model's constructor, e.g. {num_classes: 10}.
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The model a named preset (model=resnet18, ...) is for: model.name=X with another
    # preset would inherit that preset's weights, so it is refused (use model=torchvision).
    preset: str | None = None
    # The layer CAM / Grad-CAM read (the last feature maps); `auto`: picked by a probe of
    # one sample (hookrun/pipeline/camlayer.py), the run log says which.
    cam_layer: str | None = "auto"
    # model.source=hf (hookrun/models/hf.py): a folder written by save_pretrained (read
    # offline), or a transformers config for a random init (seeded), e.g.
    # {model_type: gpt2, n_layer: 2}; `tokenizer` a tokenizer folder (null: model.path's, or
    # for `config` a byte-level tokenizer made from no files).
    path: str | None = None
    config: dict[str, Any] | None = None
    tokenizer: str | None = None
    # `model.class` in the config (a Python keyword, so `class_` here): causal_lm | masked_lm
    # | base | sequence_classification.
    class_: str = "causal_lm"
    # float32 | bfloat16 | float16
    dtype: str = "float32"
    # eager | sdpa: the attention implementation (hookrun/models/hf.py says which to pick).
    attention: str = "eager"
    # Run Python code a model folder ships (auto_map); refused unless true.
    trust_remote_code: bool = False
    # A model spread over devices, the CPU and disk, through Accelerate (models/placement.py):
    # auto | balanced | balanced_low_0 | sequential, or {module name: cuda:N | cpu | disk};
    # max_memory {device: bytes, e.g. 10GiB}; offload_folder for the weights put on disk.
    device_map: Any = None
    max_memory: Any = None
    offload_folder: str | None = None
