"""Config schemas (registered in Hydra's ConfigStore) and their validation.

The top level is a structured config, so Hydra itself rejects an unknown top-level key or a
wrongly typed value. `model`, `dataset` and each entry of `hooks` are free-form nodes in the
schema (Hydra cannot add new keys under a typed dict from the command line); `validate()`
merges each into its own dataclass here and turns OmegaConf's errors into one-line messages
that name the key, the bad value and the valid choices.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hookrun.actions import build_action
from hookrun.errors import HookrunError, nearest

__all__ = [
    "Site",
    "TargetKind",
    "StoreDtype",
    "Compression",
    "ModelConfig",
    "FakeDatasetConfig",
    "ConstantDatasetConfig",
    "PhotoTransformConfig",
    "ImageFolderDatasetConfig",
    "SamplesDatasetConfig",
    "DigitsDatasetConfig",
    "SelectConfig",
    "HookConfig",
    "TargetConfig",
    "SinkConfig",
    "DeviceConfig",
    "RunConfig",
    "ValidConfig",
    "validate",
    "parse_typed",
    "register_configs",
]


class Site(str, Enum):
    """Where on a module a hook acts."""

    input = "input"  # the module's positional inputs, before it runs (forward pre-hook)
    output = "output"  # the module's output (forward hook)
    grad_input = "grad_input"  # gradient w.r.t. the module's input, through this module only
    grad_output = "grad_output"  # gradient w.r.t. the module's output

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


class StoreDtype(str, Enum):
    float32 = "float32"
    float16 = "float16"


class Compression(str, Enum):
    lzf = "lzf"
    gzip = "gzip"


@dataclass
class ModelConfig:
    # A torchvision classification model name (`resnet18`, ...) or a seed model
    # (`seed_mlp`, `seed_convnet`); ignored when `_target_` is set.
    name: str | None = None
    # Dotted path of the user's own nn.Module class; built with `kwargs`.
    _target_: str | None = None
    # A torchvision weights name (IMAGENET1K_V1, DEFAULT), a path to a state_dict file,
    # or null for random init (seeded by the top-level `seed`).
    weights: str | None = None
    # Keyword arguments for the model's constructor, e.g. {num_classes: 10}.
    kwargs: dict[str, Any] = field(default_factory=dict)
    # The layer CAM / Grad-CAM read (the last feature maps); each preset names its own.
    cam_layer: str | None = None


@dataclass
class FakeDatasetConfig:
    kind: str = "fake"
    # Number of samples; each is drawn from a generator seeded by (seed, index).
    size: int = 8
    image_size: int = 224
    channels: int = 3
    num_classes: int = 1000


@dataclass
class ConstantDatasetConfig:
    kind: str = "constant"
    # Shape of one sample (no batch axis), e.g. [3] for the seed MLP.
    shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    value: float = 1.0
    size: int = 1


@dataclass
class PhotoTransformConfig:
    # Resize the short side, centre-crop, normalize (ImageNet statistics by default).
    resize: int = 256
    crop: int = 224
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])


@dataclass
class ImageFolderDatasetConfig(PhotoTransformConfig):
    kind: str = "image_folder"
    # A folder with one sub-folder per class (torchvision.datasets.ImageFolder layout).
    root: str = MISSING


@dataclass
class SamplesDatasetConfig(PhotoTransformConfig):
    kind: str = "samples"
    # Photos bundled with scikit-image (skimage.data), by function name; see data.py.
    names: list[str] = field(default_factory=lambda: ["chelsea", "coffee", "rocket"])


@dataclass
class DigitsDatasetConfig:
    kind: str = "digits"
    # scikit-learn's bundled 8x8 handwritten digits; every 5th image is the test split.
    split: str = "test"


DATASET_SCHEMAS: dict[str, type] = {
    "fake": FakeDatasetConfig,
    "constant": ConstantDatasetConfig,
    "image_folder": ImageFolderDatasetConfig,
    "samples": SamplesDatasetConfig,
    "digits": DigitsDatasetConfig,
}


@dataclass
class SelectConfig:
    # Globs over qualified module names (`*` crosses dots, never matches the root);
    # `input` names the model-input pseudo-layer.
    name: Any = None
    # Regular expressions, full match.
    regex: Any = None
    # Class names: short torch.nn names (ReLU) or dotted import paths.
    type: Any = None
    # Globs to drop from what the other keys matched.
    exclude: Any = None


@dataclass
class HookConfig:
    select: SelectConfig = field(default_factory=SelectConfig)
    at: Site = MISSING
    action: str = MISSING
    args: dict[str, Any] = field(default_factory=dict)
    # The backward pass a gradient-site hook acts in. Passes share one forward pass and
    # never see each other's changes: guided_grad_cam takes plain gradients at the CAM layer
    # in pass `main` and Guided Backprop's clamped ones at the input in pass `guided`.
    backward: str = "main"


@dataclass
class TargetConfig:
    kind: TargetKind = TargetKind.predicted
    # The class to start from when kind=index.
    index: int | None = None


@dataclass
class SinkConfig:
    # Where captures.h5 goes; null = <run dir>/captures.h5.
    path: str | None = None
    dtype: StoreDtype = StoreDtype.float32
    compression: Compression | None = None
    # Replace an existing file at `path` (otherwise an existing file stops the run).
    overwrite: bool = False
    # Batches waiting for the writer thread before the producer blocks.
    queue_depth: int = 4


@dataclass
class DeviceConfig:
    # cpu | cuda | cuda:N | auto (cuda when available, else cpu)
    name: str = "cpu"
    # TF32 convolutions/matmuls change numbers at the 1e-3 level; off unless asked for.
    allow_tf32: bool = False


@dataclass
class RunConfig:
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
    # Results computed from captures per batch: method → {layer: ...} (hookrun/derive.py).
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


@dataclass
class ValidConfig:
    """The run config after validation: every node typed, every range checked."""

    model: ModelConfig
    dataset: Any  # one of the *DatasetConfig classes
    hooks: dict[str, HookConfig]
    run: RunConfig


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


def _keys_of(schema: type) -> list[str]:
    return [f.name for f in fields(schema)]


def parse_typed(node: Any, schema: type, key: str) -> Any:
    """Merge a free-form config node into `schema`; errors name `key.<field>`."""
    if node is None:
        node = {}
    if not isinstance(node, (dict, DictConfig)):
        raise HookrunError(f"{key}: expected a mapping with keys {_keys_of(schema)}, got {node!r}")
    raw = OmegaConf.create(node) if isinstance(node, dict) else node
    valid = _keys_of(schema)
    for name in raw:
        if name not in valid:
            hint = nearest(str(name), valid, n=1)
            did = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise HookrunError(f"{key}.{name}: unknown key{did}; valid keys: {', '.join(valid)}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        sub = getattr(err, "full_key", None) or getattr(err, "key", None)
        where = f"{key}.{sub}" if sub else key
        msg = str(getattr(err, "msg", err)).splitlines()[0]
        raise HookrunError(f"{where}: {msg}") from None


def _check_range(key: str, value: int | None, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < low:
        raise HookrunError(f"{key}: {value!r} is out of range; valid: an integer >= {low}")


_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def validate(cfg: DictConfig) -> ValidConfig:
    """Check the whole config before any work is done; raise HookrunError on the first problem."""
    run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    model = parse_typed(run.model, ModelConfig, "model")
    if not model.name and not model._target_:
        raise HookrunError("model: set model.name (e.g. model=resnet18) or model._target_")

    kind = (run.dataset or {}).get("kind") if isinstance(run.dataset, dict) else None
    if kind not in DATASET_SCHEMAS:
        raise HookrunError(
            f"dataset.kind: {kind!r} is not a dataset kind; valid: {', '.join(DATASET_SCHEMAS)}"
        )
    dataset = parse_typed(run.dataset, DATASET_SCHEMAS[kind], "dataset")
    if kind in ("fake", "constant"):
        _check_range("dataset.size", dataset.size, 1)
    if kind == "fake":
        _check_range("dataset.image_size", dataset.image_size, 1)
        _check_range("dataset.channels", dataset.channels, 1)
        _check_range("dataset.num_classes", dataset.num_classes, 1)
    if kind == "constant":
        for i, n in enumerate(dataset.shape):
            _check_range(f"dataset.shape[{i}]", n, 1)
    if isinstance(dataset, PhotoTransformConfig):
        _check_range("dataset.resize", dataset.resize, 1)
        _check_range("dataset.crop", dataset.crop, 1)
        if len(dataset.mean) != len(dataset.std) or any(v <= 0 for v in dataset.std):
            raise HookrunError(
                f"dataset.std: {dataset.std} for mean {dataset.mean}; valid: one positive "
                "number per channel"
            )
    if kind == "digits" and dataset.split not in ("train", "test", "all"):
        raise HookrunError(f"dataset.split: {dataset.split!r}; valid: train, test, all")

    _check_range("batch_size", run.batch_size, 1)
    _check_range("limit", run.limit, 1, allow_none=True)
    _check_range("num_workers", run.num_workers, 0)
    _check_range("sink.queue_depth", run.sink.queue_depth, 1)
    _check_range("render_max", run.render_max, 1)
    if run.logger not in (None, "tensorboard"):
        raise HookrunError(f"logger: {run.logger!r}; valid: null, tensorboard")
    for method, spec in (run.derive or {}).items():
        if not isinstance(spec, dict) or not spec.get("layer"):
            raise HookrunError(
                f"derive.{method}.layer: {spec!r} names no layer; set model.cam_layer=NAME "
                "(the model presets set it) or derive.{method}.layer"
            )
    if not _DEVICE.match(run.device.name):
        raise HookrunError(
            f"device.name: {run.device.name!r} is not a device; valid: cpu, cuda, cuda:N, auto"
        )

    hooks: dict[str, HookConfig] = {}
    for name, node in (run.hooks or {}).items():
        hooks[name] = parse_typed(node, HookConfig, f"hooks.{name}")
        # The action and its args are checked here, before any model or data is loaded.
        build_action(hooks[name].action, hooks[name].args, f"hooks.{name}")
    if run.target.kind == TargetKind.index and run.target.index is None:
        raise HookrunError("target.index: null; target.kind=index needs target.index=K")
    for name, spec in hooks.items():
        if spec.backward != "main" and not spec.at.is_grad:
            raise HookrunError(
                f"hooks.{name}.backward: {spec.backward!r} on a forward site ({spec.at.value}); "
                "only grad_input and grad_output hooks belong to a backward pass"
            )
    if run.target.kind == TargetKind.none:
        grad = [n for n, h in hooks.items() if h.at.is_grad]
        if grad:
            raise HookrunError(
                f"target.kind: 'none' runs no backward pass, but hooks {grad} act at a gradient "
                "site; valid: predicted, label, index, sum"
            )
    if run.resume and run.sink.overwrite:
        raise HookrunError("sink.overwrite: true with resume=true would lose the rows to resume")
    return ValidConfig(model=model, dataset=dataset, hooks=hooks, run=run)
