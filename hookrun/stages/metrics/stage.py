"""The metrics stage (`metrics:`, e.g. `metrics=lm`): per batch, one pass of the causal
language model under the run's value-changing hooks and one without them, each over every
position; the metrics of both (compute.py) stored at /metrics/<name> and
/metrics/<name>_unhooked, /metrics/kl between them. The summary prints each mean and its
change; a sweep's summary gets a column per metric (and its change), and the sweep ranks its
jobs by the change of `metrics.rank_by` (ranking.py), so a multirun over heads ablated ranks
them by the loss change with no code of the user's."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from hookrun.errors import HookrunError
from hookrun.io.encoding import read_floats
from hookrun.memory import check_fits
from hookrun.models.adapter import adapt
from hookrun.runtime.hooks import attach
from hookrun.runtime.plan import HookPlan
from hookrun.runtime.targets import TargetKind
from hookrun.stage import ParseContext, Plan, Setup, Stage, Stored, Work, register_stage
from hookrun.stages.metrics.compute import KL_MEANING, KL_SAID, NAMES, PAIRED, kl, row_metrics
from hookrun.stages.metrics.keys import METRICS_GROUP, UNHOOKED, metric_key
from hookrun.stages.metrics.ranking import RANK_BY, write_metrics_ranking
from hookrun.typed import Frozen, check_choices, parse_typed

__all__ = ["MetricsStage", "MetricsConfig"]

log = logging.getLogger("hookrun")

_TOKEN_TARGETS = (
    TargetKind.predicted,
    TargetKind.next_token,
    TargetKind.answer,
    TargetKind.logit_diff,
)


@dataclass
class MetricsConfig(Frozen):
    names: list[str] = field(default_factory=lambda: ["loss", "answer_logprob", "kl"])
    """Any of loss, token_loss, answer_logprob, logit_diff, kl (compute.py)."""
    rank_by: str | None = None
    """A sweep ranks its jobs by this metric's change, largest first (metrics_ranking.csv); null:
    loss, or the first of `names` with an unhooked twin.
    """


def _rankable(names: Any) -> list[str]:
    """The metrics a sweep can rank by: one number per row, hooked and unhooked."""
    return [n for n in names if n in PAIRED and n != "token_loss"]


def parse_metrics(raw: Any) -> MetricsConfig | None:
    if not raw:
        return None
    given = raw.get("names", [])
    if given is None or isinstance(given, str):  # OmegaConf's words name no choices
        raise HookrunError(
            f"metrics.names: {'null' if given is None else repr(given)}; valid: a list of any "
            f"of {', '.join(NAMES)}, "
            f"e.g. [{given or 'loss'}]"
        )
    config = parse_typed(raw, MetricsConfig, "metrics")
    check_choices("metrics.names", config.names, NAMES, "a metric")
    paired = _rankable(config.names)
    if config.rank_by is not None and config.rank_by not in paired:
        raise HookrunError(
            f"metrics.rank_by: {config.rank_by!r}; valid: one of metrics.names with a value "
            f"per row hooked and unhooked: {', '.join(paired) or 'none (add loss)'}"
        )
    return config


class MetricsPlan(Plan):
    def __init__(self, names: tuple[str, ...], config: MetricsConfig, hooks: HookPlan, tokens: int):
        self.names, self.hooks, self.tokens = names, hooks, tokens
        paired = _rankable(self.names)
        self.rank_by = config.rank_by or ("loss" if "loss" in paired else next(iter(paired), None))

    def attrs(self) -> dict[str, dict]:
        return {METRICS_GROUP: {RANK_BY: self.rank_by}} if self.rank_by else {}

    def stored(self) -> dict[str, Stored]:
        out = {}
        for name in self.names:
            shape = (self.tokens,) if name == "token_loss" else ()
            said = {"meaning": KL_MEANING} if name == "kl" else {}
            out[metric_key(name)] = Stored(shape, said)
            if name in PAIRED:
                out[metric_key(name, unhooked=True)] = Stored(shape)
        return out

    def batch(self, work: Work) -> dict[str, Any]:
        batch = work.on_device
        language = adapt(work.model).language
        recorder = work.recorder({})
        recorder.begin(int(batch.index[0]))
        recorder.rows, recorder.mask = batch.index, batch.mask  # patch rows, args.positions
        targets = work.targets

        def logits() -> torch.Tensor:
            # Through the root: function sites (attention patterns) see the pass.
            out = language(input_ids=batch.tokens, attention_mask=batch.mask, use_cache=False)
            return out.logits

        with torch.inference_mode():
            with attach(self.hooks, work.model, recorder):
                hooked = logits()
            unhooked = logits()  # the run's own hooks stand aside during a stage's work
            parts = (batch.tokens, batch.mask, batch.read, targets)
            out = {metric_key(k): v for k, v in row_metrics(hooked, *parts, self.names).items()}
            plain = row_metrics(unhooked, *parts, self.names)
            out |= {metric_key(k, unhooked=True): v for k, v in plain.items() if k in PAIRED}
            if "kl" in self.names:
                out[metric_key("kl")] = kl(hooked, unhooked, batch.mask)
        return {k: v.float().cpu() for k, v in out.items()}


@register_stage
class MetricsStage(Stage):
    name = node = "metrics"
    order = 55
    axes = {metric_key("token_loss*"): "sample token", f"{METRICS_GROUP}/*": "sample"}

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {"metrics": MetricsConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        return parse_metrics(raw)

    @classmethod
    def plan(cls, config: MetricsConfig, setup: Setup) -> Plan:
        language = setup.causal_language("metrics")
        names, added = _with_steering_effect(config, setup)
        kind = setup.spec.target.kind

        def key(name: str) -> str:  # who asked for the metric
            return "steering.effect" if name in added else "metrics.names"

        wants_target = [n for n in names if n in ("answer_logprob", "logit_diff")]
        if wants_target and kind not in _TOKEN_TARGETS:
            raise HookrunError(
                f"{key(wants_target[0])}: {wants_target[0]} with target.kind={kind.value}, which "
                f"names no token; valid: {', '.join(k.value for k in _TOKEN_TARGETS)}"
            )
        if "logit_diff" in names and kind != TargetKind.logit_diff:
            raise HookrunError(
                f"{key('logit_diff')}: logit_diff with target.kind={kind.value}; valid: "
                "target.kind=logit_diff (prompts with a counterfactual_answer)"
            )
        # Every token kind's rows have the padded width of sample 0's (its last axis); a
        # batch holds no more rows than the run has.
        tokens = int(setup.sample.shape[-1])
        rows = min(setup.spec.batch_size, len(setup.data))
        vocab = int(language.config.vocab_size)
        check_fits(
            "batch_size",
            setup.spec.batch_size,
            3 * 4 * rows * tokens * vocab,
            f"the logits of metrics' two passes [{rows}, {tokens}, {vocab}]",
        )
        if added:
            log.info(
                "metrics: %s computed too, for steering.effect (metrics.names: %s)",
                ", ".join(added),
                ", ".join(config.names),
            )
        return MetricsPlan(names, config, setup.plan.acting(), tokens)

    @classmethod
    def rank(cls, sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
        return write_metrics_ranking(sweep_dir, jobs)

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        return [f"metrics: {name} {text}" for name, text in _means(f, rows).items()]

    @classmethod
    def columns(cls, f: h5py.File, rows: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, (hooked, unhooked) in _pairs(f, rows).items():
            out[f"metrics:{name}"] = hooked
            if unhooked is not None:
                out[f"metrics:{name}{UNHOOKED}"] = unhooked
                out[f"metrics:{name}_change"] = hooked - unhooked
        return out


def _with_steering_effect(config: MetricsConfig, setup: Setup) -> tuple[tuple[str, ...], list[str]]:
    """The metrics the run computes: `metrics.names`, and the metric whose change is a
    steering run's effect (`steering.effect`) where the names leave it out; and those added."""
    steering = setup.spec.stage("steering")
    effect = getattr(steering, "effect", None)
    added = [effect] if effect is not None and effect not in config.names else []
    return (*config.names, *added), added


def _pairs(f: h5py.File, rows: int) -> dict[str, tuple[float, float | None]]:
    """Each stored per-row metric's mean over the rows: (hooked, unhooked or None)."""
    group = f.get(METRICS_GROUP)
    if group is None:
        return {}
    out: dict[str, tuple[float, float | None]] = {}
    for name in NAMES:
        if name not in group or name == "token_loss":
            continue
        hooked = float(np.nanmean(read_floats(group[name], slice(0, rows))))
        other = group.get(f"{name}{UNHOOKED}")
        plain = float(np.nanmean(read_floats(other, slice(0, rows)))) if other is not None else None
        out[name] = (hooked, plain)
    return out


def _means(f: h5py.File, rows: int) -> dict[str, str]:
    out = {}
    for name, (hooked, plain) in _pairs(f, rows).items():
        if name == "kl":
            out[name] = f"{hooked:.4g} nats, mean over {rows} rows ({KL_SAID})"
        elif plain is None:
            out[name] = f"{hooked:.4g} (mean over {rows} rows)"
        else:
            out[name] = f"{hooked:.4g} hooked, {plain:.4g} unhooked ({hooked - plain:+.4g})"
    return out
