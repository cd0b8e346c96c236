"""The logit lens as a stage: the method itself is a derived method (`derive.logit_lens`,
lens.py, registered with the derive stage); this stage names its tables' axes and draws
them (draw.py), which the pictures of derived maps leave out."""

from __future__ import annotations

from typing import Any

import h5py

from hookrun.io import layout
from hookrun.stage import Stage, register_stage
from hookrun.stages.lens.lens import LOGIT_LENS

__all__ = ["LensStage"]


@register_stage
class LensStage(Stage):
    name = "logit_lens"
    order = 60
    axes = {
        layout.derived_key(LOGIT_LENS, "top_*"): "sample layer position k",
        layout.derived_key(LOGIT_LENS, "target_prob"): "sample layer",
    }
    draws = (layout.derived_key(LOGIT_LENS, "*"),)

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Any, rows: int, config: dict) -> list:
        from hookrun.stages.lens.draw import render_lens  # matplotlib: when drawing

        return render_lens(f, out_dir, rows, config)
