"""The induction-score stage: a run over `dataset=repeated_tokens` that captures attention
patterns (experiment=induction) gets each row's induction score per head, batch by batch,
and each head's score over every row once they are all in the file (scores.py). It reads no
config node: the data and the hooks say it is wanted."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
import torch

from hookrun.data.repeated import KIND
from hookrun.errors import HookrunError
from hookrun.io import layout
from hookrun.runtime.sites import Site
from hookrun.stage import Plan, Setup, Stage, Stored, WholeRun, Work, register_stage
from hookrun.stages.induction.keys import INDUCTION_ROWS, INDUCTION_SCORE, LAYERS_ATTR
from hookrun.stages.induction.scores import batch_rows, induction_score

__all__ = ["InductionStage"]

layout.whole_run(INDUCTION_SCORE)  # one score per head for the run: no sample axis


class InductionPlan(Plan):
    def __init__(self, layers: list[str], heads: int, length: int, start: int, rows: int):
        self.layers, self.heads, self.rows = layers, heads, rows
        self.length, self.start = length, start

    def stored(self) -> dict[str, Stored]:
        return {INDUCTION_ROWS: Stored((len(self.layers), self.heads))}

    def batch(self, work: Work) -> dict[str, Any]:
        """Each row's score per head, from the patterns as the file stores them."""
        patterns = [
            torch.as_tensor(work.records[layout.pattern_key(layer)]).double().numpy()
            for layer in self.layers
        ]
        return {INDUCTION_ROWS: batch_rows(patterns, self.length, self.start)}

    def finishes(self) -> dict[str, WholeRun]:
        shape = (len(self.layers), self.heads)
        return {INDUCTION_SCORE: WholeRun(shape, "float32", {LAYERS_ATTR: list(self.layers)})}

    def finish(self, f: h5py.File) -> dict[str, np.ndarray]:
        return {INDUCTION_SCORE: induction_score(f, self.rows)}


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
        captures = any(h.site == Site.pattern and h.action.records for h in setup.plan.hooks)
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
        # The modules whose (first) pattern is captured, in model order.
        layers = [
            name
            for name, _ in setup.model.named_modules()
            if layout.pattern_key(name) in setup.captures
        ]
        if not layers:
            return None
        heads = int(setup.captures[layout.pattern_key(layers[0])][0])
        start = int(bool(dataset.prepend_bos))
        return InductionPlan(layers, heads, int(dataset.length), start, len(setup.data))

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.induction.draw import render_induction  # matplotlib: when drawing

        return render_induction(f, out_dir)
