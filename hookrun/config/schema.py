"""The config schema Hydra composes into (registered in Hydra's ConfigStore).

The top level is a structured config, so Hydra itself rejects an unknown top-level key or a
wrongly typed value. `model`, `dataset`, `derive` and each entry of `hooks` are free-form
nodes here (Hydra cannot add new keys under a typed dict from the command line); the spec
builder (`hookrun/config/build.py`) merges each into its own dataclass — model here, dataset
kinds in `hookrun/data/kinds.py`, action args in `hookrun/runtime/actions.py`, derived
methods in `hookrun/stages/derive/registry.py` — and turns OmegaConf's errors into one-line
messages.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from hookrun.typed import Frozen

__all__ = [
    "Site",
    "TargetKind",
    "StoreDtype",
    "Compression",
    "ModelConfig",
    "SelectConfig",
    "HookConfig",
    "TargetConfig",
    "SinkConfig",
    "DeviceConfig",
    "RunConfig",
    "conf_dir",
    "register_configs",
]


class Site(str, Enum):
    """Where on a module a hook acts."""

    input = "input"  # the module's positional inputs, before it runs (forward pre-hook)
    output = "output"  # the module's output (forward hook)
    grad_input = "grad_input"  # gradient w.r.t. the module's input, through this module only
    grad_output = "grad_output"  # gradient w.r.t. the module's output
    # An attention module's probabilities per head (N, heads, query, key): the softmax its
    # forward computes (hookrun/runtime/plan.py binds it to that call; eager attention only).
    pattern = "pattern"

    @property
    def is_grad(self) -> bool:
        return self in (Site.grad_input, Site.grad_output)


class TargetKind(str, Enum):
    """What the backward pass starts from."""

    predicted = "predicted"
    label = "label"
    index = "index"
    sum = "sum"
    none = "none"
    # Language models (token data): the actual next token of a text row at its read
    # position (dataset.read), or the first token of a prompt's answer — the row's label.
    next_token = "next_token"
    answer = "answer"
    # logit(answer) − logit(counterfactual_answer) of a prompt (dataset=prompts rows with both):
    # /samples/target holds the answer, /samples/counterfactual_target the other token.
    logit_diff = "logit_diff"


class StoreDtype(str, Enum):
    float32 = "float32"
    float16 = "float16"
    # Stored as its raw 16 bits (uint16) with the attribute dtype=bfloat16 (io/layout.py):
    # h5py and numpy have no bfloat16, and the bits read back exactly.
    bfloat16 = "bfloat16"


class Compression(str, Enum):
    lzf = "lzf"
    gzip = "gzip"


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


@dataclass
class SelectConfig(Frozen):
    # Globs over qualified module names (`*` crosses dots, never matches the root);
    # `input` names the model-input pseudo-layer.
    name: Any = None
    # Regular expressions, full match.
    regex: Any = None
    # Class names: short torch.nn names (ReLU) or dotted import paths.
    type: Any = None
    # Globs to drop from what the other keys matched.
    exclude: Any = None
    # Functions called inside forward (relu, gelu, linear, softmax, ...; hookrun/engine/
    # functions.py): each call is a site `<module>/<function>.<k>`; with name/type/regex,
    # only calls made inside the modules those match.
    function: Any = None


@dataclass
class HookConfig(Frozen):
    select: SelectConfig = field(default_factory=SelectConfig)
    at: Site = MISSING
    action: str = MISSING
    args: dict[str, Any] = field(default_factory=dict)
    # The backward pass a gradient-site hook acts in. Passes share one forward pass and
    # never see each other's changes: guided_grad_cam takes plain gradients at the CAM layer
    # in pass `main` and Guided Backprop's clamped ones at the input in pass `guided`.
    backward: str = "main"


@dataclass
class TargetConfig(Frozen):
    kind: TargetKind = TargetKind.predicted
    # The class to start from when kind=index.
    index: int | None = None


@dataclass
class SinkConfig(Frozen):
    # Where captures.h5 goes; null = <run dir>/captures.h5.
    path: str | None = None
    dtype: StoreDtype = StoreDtype.float32
    compression: Compression | None = None
    # Replace an existing file at `path` (otherwise an existing file stops the run).
    overwrite: bool = False
    # Batches waiting for the writer thread before the producer blocks.
    queue_depth: int = 4
    # HDF5 fletcher32 checksum on every chunk: a damaged chunk fails loudly when read.
    # false trades that for write speed (the checksum halves the writer's MiB/s).
    checksum: bool = True


@dataclass
class DeviceConfig(Frozen):
    # cpu | cuda | cuda:N | auto (cuda when available, else cpu)
    name: str = "cpu"
    # TF32 convolutions/matmuls change numbers at the 1e-3 level; off unless asked for.
    allow_tf32: bool = False


@dataclass
class RunConfig(Frozen):
    model: Any = MISSING
    dataset: Any = MISSING
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int = 0
    # Make PyTorch refuse nondeterministic kernels (torch.use_deterministic_algorithms).
    deterministic: bool = False
    batch_size: int = 32
    # At most this many samples (the first ones, in dataset order); null = all.
    limit: int | None = None
    num_workers: int = 0
    dry_run: bool = False
    resume: bool = False
    target: TargetConfig = field(default_factory=TargetConfig)
    hooks: dict[str, Any] = field(default_factory=dict)
    # Results computed from captures per batch: method → {layer: ...} (hookrun/methods/).
    derive: dict[str, Any] = field(default_factory=dict)
    sink: SinkConfig = field(default_factory=SinkConfig)
    # Folders searched, in order, for torchvision checkpoint files before the torch hub
    # cache and a download; a file counts only if its SHA-256 matches its name's hash.
    weights_path: list[str] = field(default_factory=list)
    # Show a tqdm progress bar.
    progress: bool = True
    # Time every stage (data, forward, backward, copy, write, queue wait) and print it.
    profile: bool = False
    # Pictures from the finished captures.h5 into <run dir>/images/<experiment>/.
    render: bool = True
    # Pictures for at most this many samples (the first rows).
    render_max: int = 16
    # null, or tensorboard: the pictures and the plan also go to <run dir>/tensorboard.
    logger: str | None = None
    # Faithfulness of the run's attributions (evaluate=faithfulness; hookrun/evaluate/):
    # metrics, of, reduce, batch_size, rank_by and each metric's arguments. {}: none.
    evaluate: Any = field(default_factory=dict)
    # The sanity check by model randomisation (experiment=sanity_check). {}: none.
    sanity: Any = field(default_factory=dict)
    # Activation patching (experiment=lm_patching; hookrun/patching/): sites, positions,
    # batch_size, memory_mib. {}: none.
    patching: Any = field(default_factory=dict)


def conf_dir() -> Path:
    """The config tree: conf/ inside the installed package, else the checkout's conf/."""
    packaged = Path(str(importlib.resources.files("hookrun"))) / "conf"
    if (packaged / "config.yaml").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "conf"


def _package_dir(name: str) -> str:
    """`${pkg_dir:NAME}`: the folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return f"<package {name} is not installed>"
    return str(list(spec.submodule_search_locations)[0])


def register_configs() -> None:
    """Store the top-level schema so conf/config.yaml can extend it; register resolvers."""
    ConfigStore.instance().store(name="hookrun_schema", node=RunConfig)
    OmegaConf.register_new_resolver("pkg_dir", _package_dir, replace=True)
