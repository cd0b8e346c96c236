"""The induction-score stage: a run over `dataset=repeated_tokens` that captures attention
patterns (experiment=induction) gets each head's induction score, written once its file is
complete (scores.py). It reads no config node: the data and the hooks say it is wanted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py

from hookrun.data.repeated import KIND
from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.runtime.sites import Site
from hookrun.stage import Plan, Setup, Stage, register_stage
from hookrun.stages.induction.keys import INDUCTION_ROWS, INDUCTION_SCORE
from hookrun.stages.induction.scores import write_induction

__all__ = ["InductionStage"]

layout.whole_run(INDUCTION_SCORE)  # one score per head for the run: no sample axis


class InductionPlan(Plan):
    def __init__(self, modules: list[str], length: int, start: int) -> None:
        self.modules, self.length, self.start = modules, length, start

    def finish(self, path: Path) -> None:
        write_induction(path, self.modules, self.length, self.start)


@register_stage
class InductionStage(Stage):
    name = "induction"
    order = 50
    axes = {INDUCTION_SCORE: "layer head", INDUCTION_ROWS: "sample layer head"}

    @classmethod
    def plan(cls, config: Any, setup: Setup) -> Plan | None:
        """Scored where the rows are repeated tokens and attention patterns are captured;
        refused before any work where the rows hold no later repeat to score."""
        dataset = setup.spec.dataset
        captures = any(h.site == Site.pattern and h.action.captures for h in setup.plan.hooks)
        if getattr(dataset, "kind", None) != KIND or not captures:
            return None
        if dataset.repeats < 2:
            raise HookrunError(
                f"dataset.repeats: {dataset.repeats} writes each row's {dataset.length} tokens "
                "once, but the induction score of the captured attention patterns reads a "
                "later repeat's attention to the earlier copy; valid: 2 or more"
            )
        if dataset.length < 2:
            raise HookrunError(
                f"dataset.length: {dataset.length}: a sequence of one token repeated makes the "
                "token after its earlier copy the query itself, so the induction score would "
                "be each head's attention to its own position; valid: 2 or more"
            )
        modules = [name for name, _ in setup.model.named_modules()]
        return InductionPlan(modules, int(dataset.length), int(bool(dataset.prepend_bos)))

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.induction.draw import render_induction  # matplotlib: when drawing

        return render_induction(f, out_dir)
