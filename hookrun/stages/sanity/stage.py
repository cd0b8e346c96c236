"""The sanity-check stage (`sanity:`, experiment=sanity_check): each checked method's map on
the original model and after each randomisation step, batch by batch (check.py), compared
with the original's; each method's verdict is written from all the rows before the file is
complete (verdicts.py)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import h5py
from torch import nn

from hookrun.data.batch import Batch
from hookrun.runtime.hooks import attach, weights_kept
from hookrun.runtime.step import BatchStep, RowFacts
from hookrun.runtime.targets import TargetConfig, TargetKind
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
from hookrun.stages.derive.registry import derive
from hookrun.stages.derive.stage import method_schemas, says_auto, with_layer
from hookrun.stages.evaluate.stage import check_class
from hookrun.stages.sanity.check import PreparedMethod, SanityCheck, prepare_sanity
from hookrun.stages.sanity.config import SanityConfig, SanitySpec, sanity_spec
from hookrun.stages.sanity.keys import SANITY, read_sanity, sanity_key
from hookrun.stages.sanity.verdicts import read_verdicts, write_verdicts

__all__ = ["SanityStage"]

# The methods explain the original model's targets, handed in as labels.
_GIVEN_TARGETS = TargetConfig(kind=TargetKind.label)


class SanityPlan(Plan):
    def __init__(self, check: SanityCheck) -> None:
        self.check = check

    def stored(self) -> dict[str, Stored]:
        return self.check.stored()

    def attrs(self) -> dict[str, dict]:
        return self.check.attrs()

    def describe(self, itemsize: int) -> str:
        check = self.check
        return (
            describe_stored(self.stored(), itemsize, "Evaluation")
            + f"\nSanity check ({check.config.mode}) randomises: {', '.join(check.layers)}"
        )

    def guard(self, model: nn.Module) -> AbstractContextManager:
        return weights_kept(model)  # randomised step by step, the trained weights come back

    def batch(self, work: Work) -> dict[str, Any]:
        # The original model's targets, handed in as labels.
        given = Batch(work.inputs, work.targets.cpu(), work.batch.index)
        return self.check.batch(given, lambda m, b: _method_records(work, m, b))


def _method_records(work: Work, method: PreparedMethod, batch: Batch) -> Mapping:
    """One method on one batch, on the model as it is now: its own hooks attached (the
    run's stand aside), a forward pass, its backward passes, then its derived results;
    the batch's labels are the targets it explains."""
    recorder = work.recorder(method.folds)
    step = BatchStep(
        work.model, method.plan, recorder, _GIVEN_TARGETS, work.step.device, RowFacts()
    )
    with attach(method.plan, work.model, recorder):
        records = step(batch)
    for event in recorder.events:
        event.synchronize()
    if method.derivations:
        records.update(derive(method.derivations, records, step.context()))
    return records


@register_stage
class SanityStage(Stage):
    name = node = "sanity"
    order = 30
    changes_weights = True  # randomised step by step
    axes = {
        # Columns: the randomisation steps (0: the trained model).
        sanity_key("*", "maps"): "sample step y x",
        f"{SANITY}/*": "sample step",
    }

    @classmethod
    def schema(cls) -> Mapping[str, type]:
        return {"sanity": SanityConfig, **method_schemas("sanity.derive")}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> Any:
        spec = sanity_spec(raw, ctx)
        if spec is not None:
            check_class(ctx.target, "sanity")
        return spec

    @classmethod
    def says_auto(cls, config: SanitySpec) -> bool:
        return any(
            says_auto(m.derive) or any(h.select.name == "auto" for h in m.hooks)
            for m in config.methods
        )

    @classmethod
    def resolve_layer(cls, config: SanitySpec, layer: str) -> SanitySpec:
        from dataclasses import replace

        from hookrun.runtime.hookspec import with_layer as hooks_with_layer

        methods = tuple(
            replace(m, hooks=hooks_with_layer(m.hooks, layer), derive=with_layer(m.derive, layer))
            for m in config.methods
        )
        return replace(config, methods=methods)

    @classmethod
    def needs_input_gradient(cls, config: Any) -> str | None:
        return "sanity"

    @classmethod
    def plan(cls, config: SanitySpec, setup: Setup) -> Plan | None:
        spec = setup.spec
        return SanityPlan(
            prepare_sanity(config, setup.model, setup.sample, spec.seed, setup.store_dtype)
        )

    @classmethod
    def complete(cls, f: h5py.File, rows: int, shards: list[h5py.File] | None) -> None:
        write_verdicts(f, rows, shards)

    @classmethod
    def damage(cls, f: h5py.File, complete: bool) -> list[str]:
        """A complete file's sanity check has its verdicts."""
        if not complete:
            return []
        missing = [m for m, verdict in read_verdicts(f).items() if verdict is None]
        return [f"/{SANITY}/{m}: no verdict (attributes passed, score)" for m in missing]

    @classmethod
    def columns(cls, f: h5py.File, rows: int) -> dict[str, float]:
        """Each sanity-checked method's verdict score (sweep_summary.csv `sanity:<method>`)."""
        verdicts = read_verdicts(f).items()
        return {f"sanity:{method}": v[1] for method, v in verdicts if v is not None}

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        """One line per checked method: its verdict."""
        lines = []
        for method, verdict in read_verdicts(f).items():
            if verdict is not None:
                word, sign = ("PASSES", "<") if verdict[0] else ("FAILS", ">=")
                lines.append(
                    f"sanity {method}: {word} (mean median spearman_abs {verdict[1]:.2f} {sign} "
                    f"{read_sanity(f)[1]:.2f})"
                )
        return lines

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.sanity.draw import draw_sanity  # matplotlib: when drawing

        return draw_sanity(f, out_dir)
