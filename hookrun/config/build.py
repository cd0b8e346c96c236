"""The RunSpec: the composed config, typed, checked and frozen — built once per run.

`build_spec(cfg)` runs every check that needs no model, data or file: the schema, each
free-form node merged into its registered dataclass (model, dataset kind, hook actions,
derived methods), ranges and combinations. It raises HookrunError with one line naming the
key, the bad value and the valid choices. Nothing after it reads a DictConfig.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hookrun.config.schema import RunConfig
from hookrun.data.kinds import DATASETS
from hookrun.errors import HookrunError
from hookrun.extras import require_extra
from hookrun.memory import check_fits
from hookrun.models.config import ModelConfig
from hookrun.models.sources import check_model, parse_model
from hookrun.runtime.hookspec import HookConfig, HookSpec
from hookrun.runtime.targets import TargetConfig, TargetKind
from hookrun.stage import ParseContext, stages
from hookrun.typed import check_range, freeze, parse_typed

__all__ = [
    "RunSpec",
    "build_spec",
    "parse_hooks",
    "MODEL_KEYS",
    "release_model_keys",
    "check_batch",
]

log = logging.getLogger("hookrun")
_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
_LOGGERS = (None, "tensorboard")
RENDER_STYLES = ("auto", "clipped", "seed")  # render/draw.py


@dataclass(frozen=True)
class RunSpec:
    """Everything a run needs to know, typed and read-only, built once (build_spec) and never
    changed after: a resolved `auto` layer gives a new spec (dataclasses.replace).

    `config` is the composed config as its typed schema (config/schema.py: every key and
    what it means, frozen); the nodes that are free-form there come parsed: `model`, the
    `dataset` kind's config, the `hooks` (their actions built and checked) and each stage's
    node (`stages`: node → the stage's parsed config, None where the stage is off; also
    read as `spec.<node>`). Every other key reads through to the config: `spec.batch_size`
    is `spec.config.batch_size`."""

    config: RunConfig
    model: ModelConfig
    dataset: Any  # the registered dataset kind's config dataclass
    hooks: tuple[HookSpec, ...]
    stages: Mapping[str, Any]
    experiment: str | None
    # The resolved config as YAML: the file's `config` attribute, compared on resume.
    config_yaml: str

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("config", "stages"):  # pickling: not set yet
            raise AttributeError(name)
        if name in self.stages:  # a stage's node, parsed
            return self.stages[name]
        return getattr(self.config, name)

    @property
    def needs_backward(self) -> bool:
        return any(h.at.is_grad or h.action.needs_gradient for h in self.hooks)

    def stage(self, node: str) -> Any:
        """The parsed config of the stage reading `node`; None when it is off."""
        return self.stages.get(node)


def parse_hooks(raw: Any, target: TargetConfig, prefix: str = "hooks") -> tuple[HookSpec, ...]:
    """The HookSpecs of a `hooks:` node (an experiment's, for the sanity check), checked
    against the target; errors name `<prefix>.<name>`."""
    hooks = [
        HookSpec.from_config(name, parse_typed(node, HookConfig, f"{prefix}.{name}"))
        for name, node in (raw or {}).items()
    ]
    if target.kind == TargetKind.index and target.index is None:
        raise HookrunError("target.index: null; target.kind=index needs target.index=K")
    if target.kind == TargetKind.none:
        grad = [h.name for h in hooks if h.at.is_grad or h.action.needs_gradient]
        if grad:
            raise HookrunError(
                f"target.kind: 'none' runs no backward pass, but hooks {grad} act at a gradient "
                "site or record a gradient; valid: predicted, label, index, sum"
            )
    for hook in hooks:
        freeze(hook.select)
    return tuple(hooks)


def _dataset(raw: Any) -> Any:
    kind = raw.get("kind") if isinstance(raw, dict) else None
    entry = DATASETS.get(kind, "dataset.kind")
    dataset = parse_typed(raw, entry.schema, "dataset")
    dataset.check()
    return dataset


def _run_checks(run: RunConfig) -> None:
    check_range("batch_size", run.batch_size, 1)
    check_range("limit", run.limit, 1, allow_none=True)
    check_range("num_workers", run.num_workers, 0)
    check_range("sink.queue_depth", run.sink.queue_depth, 1)
    check_range("render_max", run.render_max, 1)
    if run.render_style not in RENDER_STYLES:
        raise HookrunError(f"render_style: {run.render_style!r}; valid: {', '.join(RENDER_STYLES)}")
    if not 0 <= run.seed < 2**63:  # torch's generator and the int64 `seed` attribute
        raise HookrunError(f"seed: {run.seed} is out of range; valid: 0 to 2**63 - 1")
    if run.logger not in _LOGGERS:
        raise HookrunError(f"logger: {run.logger!r}; valid: null, tensorboard")
    if run.logger == "tensorboard":  # checked before the run, not at its end (render)
        require_extra(["tensorboard"], "logger=tensorboard", "tensorboard", "logger=null")
    if not _DEVICE.match(run.device.name):
        raise HookrunError(
            f"device.name: {run.device.name!r} is not a device; valid: cpu, cuda, cuda:N, auto"
        )
    if run.resume and run.sink.overwrite:
        raise HookrunError("sink.overwrite: true with resume=true would lose the rows to resume")


def check_batch(
    batch_size: int, limit: int | None, shape: tuple[int, ...], length: int | None
) -> int:
    """Refuse a batch that cannot fit in memory: `shape` is one sample's (float32),
    `length` the dataset's rows when known. Called with the config alone where the dataset
    kind says its shape, else with the caller's first sample. The rows of a batch."""
    rows = min(n for n in (batch_size, limit, length) if n)
    sample = 4 * math.prod(shape)
    check_fits("batch_size", batch_size, rows * sample, f"one batch of {rows} x {list(shape)}")
    return rows


_CAM_LAYER = "${model.cam_layer}"


def _leaves(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every value in a config tree that is not a mapping or list."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, node


def _cam_layer_readers(node: Any) -> list[str]:
    """The keys whose value reads `model.cam_layer` (the CAM experiments' hooks and derive)."""
    return [k for k, v in _leaves(node) if isinstance(v, str) and _CAM_LAYER in v]


def _check_cam_layer(cfg: DictConfig) -> None:
    """`model.cam_layer=null` where the experiment reads it: one line naming the key, not an
    empty selector or derived layer further on."""
    if OmegaConf.select(cfg, "model.cam_layer", default="auto") is not None:
        return
    readers = _cam_layer_readers(OmegaConf.to_container(cfg, resolve=False))
    if readers:
        raise HookrunError(
            f"model.cam_layer: null, but {readers[0]} reads it; valid: auto (a probe picks "
            "the layer) or a module name of the model, e.g. layer4 (see dry_run=true)"
        )


# Keys a model preset sets for its own model (conf/model/*.yaml): with another model (the
# caller's nn.Module, or the preset's model.name changed) they fall back to `auto` (what the
# probe finds), unless the user set them. One entry per key.
MODEL_KEYS = ("model.cam_layer",)
_AUTO = "auto"


def release_model_keys(cfg: DictConfig, overrides: Sequence[str], caller_model: bool) -> None:
    """Set every MODEL_KEYS entry of `cfg` the user did not set (in `overrides`, the CLI's or
    the API's) to `auto` when the model is not the preset's: a caller's module, or a preset
    (model=mobilenet_v2) whose model.name was changed. The preset's layer names (features.18)
    mean nothing in another model."""
    preset = OmegaConf.select(cfg, "model.preset", default=None)
    name = OmegaConf.select(cfg, "model.name", default=None)
    if not caller_model and not (preset and name != preset):
        return
    given = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}
    whose = "the model you passed" if caller_model else f"model.name={name}"
    for key in MODEL_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if key in given or value in (None, _AUTO):
            continue
        with open_dict(cfg):
            OmegaConf.update(cfg, key, _AUTO, force_add=True)
        said = f"{key}: {value!r} is the {preset or 'model'} preset's; with {whose} it is auto"
        log.info("%s (the probe picks; set %s to choose)", said, key)


def _huge_ints(node: Any) -> list[tuple[str, int]]:
    """(key, value) of every integer that does not fit in 64 bits: torch, numpy and HDF5
    count in int64, and such a value would fail deep inside them instead of here."""
    return [
        (k, v)
        for k, v in _leaves(node)
        if isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**63
    ]


def build_spec(cfg: DictConfig, experiment: str | None = None) -> RunSpec:
    """The RunSpec of a composed config (without its `hydra` node); HookrunError on the
    first problem, before anything is loaded."""
    _check_cam_layer(cfg)
    huge = [h for h in _huge_ints(OmegaConf.to_container(cfg, resolve=False)) if h[0] != "seed"]
    if huge:
        key, value = huge[0]
        raise HookrunError(f"{key}: {value} is out of range; valid: an integer below 2**63")
    try:
        run: RunConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as err:  # e.g. a required `???` value left unset
        key = getattr(err, "full_key", None) or "config"
        msg = str(getattr(err, "msg", err)).splitlines()[0]
        raise HookrunError(f"{key}: {msg}") from None
    model = parse_model(run.model)
    check_model(model)
    dataset = _dataset(run.dataset)
    _run_checks(run)
    hooks = parse_hooks(run.hooks, run.target)
    if hasattr(dataset, "sample_shape"):  # a kind whose config gives its samples' shape
        check_batch(
            run.batch_size, run.limit, dataset.sample_shape(), getattr(dataset, "size", None)
        )
    ctx = ParseContext(cfg, run.target, dataset, run.batch_size, run.limit)
    parsed = {
        stage.node: stage.parse(getattr(run, stage.node), ctx) for stage in stages() if stage.node
    }
    for value in (run, model, dataset):
        freeze(value)
    return RunSpec(
        config=run,
        model=model,
        dataset=dataset,
        hooks=hooks,
        stages=MappingProxyType({k: freeze(v) for k, v in parsed.items()}),
        experiment=experiment,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
    )
