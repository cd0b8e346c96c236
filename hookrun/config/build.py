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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hookrun.config.experiments import attribution_experiments, method_nodes
from hookrun.config.schema import (
    DeviceConfig,
    HookConfig,
    ModelConfig,
    RunConfig,
    SelectConfig,
    SinkConfig,
    Site,
    TargetConfig,
    TargetKind,
)
from hookrun.data.kinds import DATASETS
from hookrun.errors import HookrunError
from hookrun.memory import check_fits
from hookrun.models.sources import check_model, parse_model
from hookrun.runtime.actions import Action, build_action
from hookrun.stages.derive.registry import METHODS
from hookrun.stages.evaluate.config import SanityConfig, parse_evaluate, parse_sanity
from hookrun.stages.patching.config import PatchingConfig, parse_patching
from hookrun.typed import check_range, freeze, parse_typed

__all__ = [
    "HookSpec",
    "SanityMethod",
    "SanitySpec",
    "RunSpec",
    "build_spec",
    "MODEL_KEYS",
    "release_model_keys",
    "check_sizes",
]

log = logging.getLogger("hookrun")
_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
_LOGGERS = (None, "tensorboard")


@dataclass(frozen=True)
class HookSpec:
    """One entry of `hooks:`, with its action built and checked."""

    name: str
    select: SelectConfig
    at: Site
    action: Action
    backward: str = "main"

    @classmethod
    def from_config(cls, name: str, cfg: HookConfig) -> HookSpec:
        """The spec of hook `name`; its action and args checked (errors name hooks.<name>)."""
        key = f"hooks.{name}"
        action = build_action(cfg.action, cfg.args, key)
        if cfg.backward != "main" and not cfg.at.is_grad:
            raise HookrunError(
                f"{key}.backward: {cfg.backward!r} on a forward site ({cfg.at.value}); "
                "only grad_input and grad_output hooks belong to a backward pass"
            )
        return cls(name, cfg.select, cfg.at, action, cfg.backward)


@dataclass(frozen=True)
class SanityMethod:
    """One method of the sanity check: its experiment's hooks and derived results."""

    name: str  # the experiment (conf/experiment/<name>.yaml)
    hooks: tuple[HookSpec, ...]
    derive: Any  # method name → parsed Args, read-only, in file order

    @property
    def derived(self) -> str | None:
        """The derived method whose result is the map; None: the input gradient is."""
        return list(self.derive)[-1] if self.derive else None


@dataclass(frozen=True)
class SanitySpec:
    """`sanity:` parsed: its keys and each checked method's hooks and derived results."""

    config: SanityConfig
    methods: tuple[SanityMethod, ...]


@dataclass(frozen=True)
class RunSpec:
    """Everything a run needs to know, typed and read-only (see conf/config.yaml for each
    key's meaning)."""

    model: ModelConfig
    dataset: Any  # the registered dataset kind's config dataclass
    hooks: tuple[HookSpec, ...]
    derive: Any  # method name → its parsed Args, read-only mapping in file order
    target: TargetConfig
    sink: SinkConfig
    device: DeviceConfig
    seed: int
    deterministic: bool
    batch_size: int
    limit: int | None
    num_workers: int
    dry_run: bool
    resume: bool
    weights_path: tuple[str, ...]
    progress: bool
    profile: bool
    render: bool
    render_max: int
    logger: str | None
    experiment: str | None
    # The resolved config as YAML: the file's `config` attribute, compared on resume.
    config_yaml: str
    evaluate: Any = None  # EvaluateSpec (hookrun/stages/evaluate/config.py), or None
    sanity: SanitySpec | None = None
    patching: PatchingConfig | None = None  # hookrun/stages/patching/config.py (read-only)

    @property
    def needs_backward(self) -> bool:
        return any(h.at.is_grad for h in self.hooks)


def _hooks(raw: dict[str, Any], target: TargetConfig) -> tuple[HookSpec, ...]:
    hooks = [
        HookSpec.from_config(name, parse_typed(node, HookConfig, f"hooks.{name}"))
        for name, node in (raw or {}).items()
    ]
    if target.kind == TargetKind.index and target.index is None:
        raise HookrunError("target.index: null; target.kind=index needs target.index=K")
    if target.kind == TargetKind.none:
        grad = [h.name for h in hooks if h.at.is_grad]
        if grad:
            raise HookrunError(
                f"target.kind: 'none' runs no backward pass, but hooks {grad} act at a gradient "
                "site; valid: predicted, label, index, sum"
            )
    return tuple(hooks)


def _derive(raw: dict[str, Any], target: TargetConfig, prefix: str = "derive") -> dict[str, Any]:
    out = {}
    for name, node in (raw or {}).items():
        key = f"{prefix}.{name}"
        method = METHODS.get(name, key)
        args = parse_typed(node, method.Args, key)
        if hasattr(args, "layer") and not args.layer:
            raise HookrunError(
                f"{key}.layer: {node!r} names no layer; set model.cam_layer=NAME (the model "
                f"presets set it) or {key}.layer"
            )
        method.check(args, key)
        if method.runs_passes and target.kind == TargetKind.none:
            raise HookrunError(
                f"target.kind: 'none' gives {name} nothing to explain; valid: predicted, label, "
                "index, sum"
            )
        if method.needs_class and target.kind in (TargetKind.sum, TargetKind.none):
            raise HookrunError(
                f"target.kind: {target.kind.value!r} has no class for {name}; valid: predicted, "
                "label, index"
            )
        out[name] = args
    return out


def _sanity(raw: Any, cfg: DictConfig, target: TargetConfig) -> SanitySpec | None:
    """Each checked method's hooks and derived results, from its experiment file with
    `sanity.derive.<method>` over its arguments."""
    config = parse_sanity(raw, attribution_experiments())
    if config is None:
        return None
    overrides, methods = dict(config.derive), []
    for name in config.methods:
        hooks_raw, derive_raw = method_nodes(name, cfg)
        for method in derive_raw:
            if method in overrides:
                derive_raw[method] = {**(derive_raw[method] or {}), **(overrides[method] or {})}
        hooks = _hooks(hooks_raw, target)
        for hook in hooks:
            freeze(hook.select)
        derive = _derive(derive_raw, target, prefix="sanity.derive")
        methods.append(SanityMethod(name, hooks, freeze(derive)))
    for method in overrides:  # the preset's arguments for a method left out do nothing
        METHODS.get(method, f"sanity.derive.{method}")
    return SanitySpec(config, tuple(methods))


def _check_class(target: TargetConfig, evaluate: Any, sanity: SanitySpec | None) -> None:
    """Evaluation scores the target class's probability and the sanity check explains one
    class: both need a class per sample."""
    users = [k for k, v in (("evaluate", evaluate), ("sanity", sanity)) if v]
    if users and target.kind in (TargetKind.sum, TargetKind.none):
        raise HookrunError(
            f"target.kind: {target.kind.value!r} has no class for {users[0]} (it scores the "
            "target class); valid: predicted, label, index"
        )


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
    if not 0 <= run.seed < 2**63:  # torch's generator and the int64 `seed` attribute
        raise HookrunError(f"seed: {run.seed} is out of range; valid: 0 to 2**63 - 1")
    if run.logger not in _LOGGERS:
        raise HookrunError(f"logger: {run.logger!r}; valid: null, tensorboard")
    if not _DEVICE.match(run.device.name):
        raise HookrunError(
            f"device.name: {run.device.name!r} is not a device; valid: cpu, cuda, cuda:N, auto"
        )
    if run.resume and run.sink.overwrite:
        raise HookrunError("sink.overwrite: true with resume=true would lose the rows to resume")


def check_sizes(
    batch_size: int, limit: int | None, derive: Any, shape: tuple[int, ...], length: int | None
) -> None:
    """Refuse a batch, or a derived method's extra pass, that cannot fit in memory: `shape`
    is one sample's (float32), `length` the dataset's rows when known. Called with the
    config alone where the dataset kind says its shape, else with the caller's first sample."""
    rows = min(n for n in (batch_size, limit, length) if n)
    sample = 4 * math.prod(shape)
    check_fits("batch_size", batch_size, rows * sample, f"one batch of {rows} x {list(shape)}")
    for name, args in derive.items():
        given = getattr(args, "internal_batch_size", None)
        if given:  # rows per extra pass; null sizes them to 32 MiB of input values
            each = getattr(args, "steps", None) or getattr(args, "samples", 1)
            extra = min(given, rows * each)
            what = f"one extra pass of {extra} x {list(shape)}"
            check_fits(f"derive.{name}.internal_batch_size", given, extra * sample, what)


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
    hooks = _hooks(run.hooks, run.target)
    derive = _derive(run.derive, run.target)
    if hasattr(dataset, "sample_shape"):  # a kind whose config gives its samples' shape
        size = getattr(dataset, "size", None)
        check_sizes(run.batch_size, run.limit, derive, dataset.sample_shape(), size)
    evaluate = parse_evaluate(run.evaluate)
    sanity = _sanity(run.sanity, cfg, run.target)
    _check_class(run.target, evaluate, sanity)
    spec = RunSpec(
        model=model,
        dataset=dataset,
        hooks=hooks,
        derive=derive,
        target=run.target,
        sink=run.sink,
        device=run.device,
        seed=run.seed,
        deterministic=run.deterministic,
        batch_size=run.batch_size,
        limit=run.limit,
        num_workers=run.num_workers,
        dry_run=run.dry_run,
        resume=run.resume,
        weights_path=tuple(run.weights_path),
        progress=run.progress,
        profile=run.profile,
        render=run.render,
        render_max=run.render_max,
        logger=run.logger,
        experiment=experiment,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        evaluate=evaluate,
        sanity=sanity,
        patching=parse_patching(run.patching),
    )
    for value in (model, dataset, run.target, run.sink, run.device):
        freeze(value)
    for hook in hooks:
        freeze(hook.select)
    object.__setattr__(spec, "derive", freeze(derive))
    if evaluate is not None:
        freeze(evaluate.config)
        for _, args in evaluate.metrics:
            freeze(args)
    if sanity is not None:
        freeze(sanity.config)
    return spec
