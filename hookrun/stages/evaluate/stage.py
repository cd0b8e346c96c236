"""The evaluation stage (`evaluate:`, evaluate=faithfulness): every metric of every
attribution the run makes (a derived map, a captured input gradient), batch by batch on the
bare model, at /evaluate/<metric>/<attribution path>; the metrics are a registry
(registry.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hookrun.errors import HookrunError
from hookrun.io import walk
from hookrun.runtime.leaves import model_logits
from hookrun.runtime.targets import TargetKind
from hookrun.stage import (
    ParseContext,
    Plan,
    Setup,
    Stage,
    Stored,
    Work,
    describe_stored,
    register_stage,
)
from hookrun.stages.evaluate.config import EvaluateConfig, parse_evaluate
from hookrun.stages.evaluate.faithfulness import Evaluation, attribution_shapes, plan_evaluation
from hookrun.stages.evaluate.keys import AUC_SUFFIX, EVALUATE, SCORE_SUFFIX
from hookrun.stages.evaluate.ranking import write_ranking
from hookrun.stages.evaluate.registry import FAITHFULNESS_METRICS

__all__ = ["EvaluateStage"]


def check_class(target: Any, key: str) -> None:
    """A stage that scores or explains the target class needs one per sample."""
    if target.kind in (TargetKind.sum, TargetKind.none):
        raise HookrunError(
            f"target.kind: {target.kind.value!r} has no class for {key} (it scores the target "
            "class); valid: predicted, label, index"
        )


class EvaluatePlan(Plan):
    def __init__(self, evaluation: Evaluation) -> None:
        self.evaluation = evaluation

    def stored(self) -> dict[str, Stored]:
        return self.evaluation.stored()

    def describe(self, itemsize: int) -> str:
        return describe_stored(self.stored(), itemsize, "Evaluation")

    def batch(self, work: Work) -> dict[str, Any]:
        return self.evaluation.batch(
            work.records,
            work.inputs,
            work.targets,
            lambda x: model_logits(work.model(x)),
            work.generator,
        )


@register_stage
class EvaluateStage(Stage):
    name = node = "evaluate"
    order = 20
    axes = {
        # A curve's columns are the fractions perturbed (its `fractions` attribute).
        f"{EVALUATE}/*{AUC_SUFFIX}": "sample",
        f"{EVALUATE}/*{SCORE_SUFFIX}": "sample",
        f"{EVALUATE}/*": "sample fraction",
    }

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {
            "evaluate": EvaluateConfig,
            **{f"evaluate.{n}": m.Args for n, m in FAITHFULNESS_METRICS.items()},
        }

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        spec = parse_evaluate(raw)
        if spec is not None:
            check_class(ctx.target, "evaluate")
        return spec

    @classmethod
    def needs_input_gradient(cls, config: Any) -> str | None:
        return "evaluate"

    @classmethod
    def plan(cls, config: Any, setup: Setup) -> Plan | None:
        made = attribution_shapes(setup.made, setup.captures)
        sample = tuple(setup.sample.shape)
        return EvaluatePlan(plan_evaluation(config, made, sample, setup.store_dtype))

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        """One line per evaluated attribution: the means over samples of its per-sample
        numbers (AUCs, ROAD score)."""
        means: dict[str, list[str]] = {}
        for metric, datasets in walk.group_of(f, EVALUATE).items():
            for name, ds in datasets.items():
                if ds.ndim != 1 or not rows:
                    continue
                for suffix in (AUC_SUFFIX, SCORE_SUFFIX):
                    if name.endswith(suffix):
                        value = float(np.mean(ds[:rows].astype(np.float64)))
                        what = f"{metric}{' AUC' if suffix == AUC_SUFFIX else ''}"
                        means.setdefault(name.removesuffix(suffix), []).append(
                            f"{what} {value:.3f}"
                        )
        return [f"evaluate {a}: {', '.join(v)} (mean of {rows})" for a, v in means.items()]

    @classmethod
    def rank(cls, sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
        return write_ranking(sweep_dir, jobs)

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.evaluate.draw import draw_evaluation  # matplotlib: when drawing

        return draw_evaluation(f, out_dir, rows, config)
