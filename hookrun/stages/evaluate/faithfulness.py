"""What a run evaluates (`evaluate:`): every metric for every attribution it is asked for,
batch by batch inside the stream, so the results are batched, streamed, resumable and
sharded like every other dataset. Attributions are read as the file stores them (the sink's
dtype); evaluation never changes how one is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.stage import Stored, drawn_by_stages
from hookrun.stages.derive.gradients import rows_per_pass
from hookrun.stages.evaluate.config import EvaluateSpec
from hookrun.stages.evaluate.registry import FAITHFULNESS_METRICS, EvalBatch
from hookrun.stages.evaluate.relevance import check_attribution, pixel_relevance

__all__ = ["Evaluation", "plan_evaluation", "attribution_shapes"]


@dataclass(frozen=True)
class Evaluation:
    """The metrics × attributions of one run, and the datasets they write."""

    spec: EvaluateSpec
    attributions: tuple[str, ...]  # record keys (captures.h5 paths) of the attributions
    image: tuple[int, int]  # (H, W) of the model input
    store_dtype: torch.dtype  # what the file holds of an attribution

    def stored(self) -> dict[str, Stored]:
        """Every dataset written, by path: per-sample shape and attributes."""
        out: dict[str, Stored] = {}
        for name, args in self.spec.metrics:
            metric = FAITHFULNESS_METRICS.get(name, "evaluate.metrics")
            for attribution in self.attributions:
                out.update(metric.stored(args, attribution, self.image))
        return out

    def batch(
        self,
        records: Mapping[str, torch.Tensor],
        inputs: torch.Tensor,
        targets: torch.Tensor,
        logits: Callable[[torch.Tensor], torch.Tensor],
        generator: Callable[[str], torch.Generator],
    ) -> dict[str, torch.Tensor]:
        """The evaluation datasets' rows for one batch (`records`: the batch's captures and
        derived results; `logits`: the bare model; `generator`: seeded per batch)."""
        reduce = self.spec.config.reduce
        relevance = {
            a: pixel_relevance(
                torch.as_tensor(records[a]).to(self.store_dtype).float(), self.image, reduce
            )
            for a in self.attributions
        }
        batch = EvalBatch(
            inputs=inputs,
            targets=targets,
            logits=logits,
            generator=generator,
            rows_per_pass=rows_per_pass(self.spec.config.batch_size, inputs),
            relevance=relevance,
        )
        out: dict[str, torch.Tensor] = {}
        for name, args in self.spec.metrics:
            metric = FAITHFULNESS_METRICS.get(name, "evaluate.metrics")
            for attribution in self.attributions:
                out.update(metric.evaluate(args, batch, attribution))
        return out


def plan_evaluation(
    spec: EvaluateSpec | None,
    made: Mapping[str, tuple[int, ...]],
    sample: tuple[int, ...],
    store_dtype: torch.dtype,
) -> Evaluation | None:
    """The Evaluation of a run whose attributions are `made` (path → per-sample shape) on
    inputs of per-sample shape `sample`; HookrunError for `evaluate.of` naming an
    attribution the run does not make, or an attribution that is not a map of the input."""
    if spec is None:
        return None
    valid = ", ".join(made) or "none (add an attribution: experiment=grad_cam, saliency, ...)"
    wanted = [a.strip("/") for a in spec.config.of] if spec.config.of else list(made)
    if not wanted:
        raise HookrunError(f"evaluate: the run makes no attribution to evaluate; valid: {valid}")
    for i, key in enumerate(wanted):
        where = f"evaluate.of[{i}]" if spec.config.of else "evaluate"
        if key not in made:
            raise HookrunError(
                f"{where}: {key!r} is not an attribution this run makes; valid: {valid}"
            )
        check_attribution(f"{where}: {key}", made[key], sample)
    image = (int(sample[-2]), int(sample[-1]))
    for name, args in spec.metrics:
        FAITHFULNESS_METRICS.get(name, "evaluate.metrics").check_image(
            args, f"evaluate.{name}", image
        )
    return Evaluation(spec, tuple(dict.fromkeys(wanted)), image, store_dtype)


def attribution_shapes(derived: Mapping[str, tuple[int, ...]], captures: Mapping[str, Any]) -> dict:
    """The attributions a run makes, path → per-sample shape: its derived results (not
    their completeness gaps) and a captured input gradient."""
    out = {
        k: v
        for k, v in derived.items()
        if not k.endswith(layout.GAP_SUFFIX) and not drawn_by_stages(k)  # tables, masks
    }
    if layout.INPUT_GRAD in captures:
        out[layout.INPUT_GRAD] = tuple(captures[layout.INPUT_GRAD])
    return out
