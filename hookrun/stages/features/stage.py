"""The `features` stage (`features:`, experiment=features): the `features:` node parsed, the
job run instead of the rows' pipeline (Stage.job); the summary and damage of its file."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

from hookrun.errors import HookrunError
from hookrun.io.features import feature_sites, site_group
from hookrun.io.layout import attr
from hookrun.stage import JobContext, JobResult, ParseContext, Stage, register_stage
from hookrun.stages.features.config import FeaturesConfig, parse_features
from hookrun.stages.features.runfile import damage, is_features_file

__all__ = ["FeaturesStage"]

_SITE = "features/*"


@register_stage
class FeaturesStage(Stage):
    name = node = "features"
    order = 6
    axes = {
        "features/vocab*": "vocabulary",
        f"{_SITE}/top/context*": "unit rank window",
        f"{_SITE}/top/patch": "unit rank channel y x",
        f"{_SITE}/top/box": "unit rank corner",
        f"{_SITE}/top/*": "unit rank",
        f"{_SITE}/quantiles/edges": "unit group_edge",
        f"{_SITE}/quantiles/context*": "unit group sample window",
        f"{_SITE}/quantiles/*": "unit group sample",
        f"{_SITE}/histogram/edges": "unit edge",
        f"{_SITE}/histogram/counts": "unit bin",
        f"{_SITE}/logits/*": "unit logit",
        f"{_SITE}/max": "unit",
        f"{_SITE}/density": "unit",
    }

    @classmethod
    def schema(cls) -> dict[str, type]:
        return {"features": FeaturesConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> FeaturesConfig | None:
        config = parse_features(raw)
        if config is not None and ctx.target.kind.value != "none":
            raise HookrunError(
                f"target.kind: {ctx.target.kind.value!r} with features: the job runs no "
                "backward pass of the model; valid: none"
            )
        return config

    @classmethod
    def job(cls, config: FeaturesConfig, spec: Any, ctx: JobContext) -> JobResult:
        from hookrun.stages.features.job import run_features

        if spec.dry_run:
            raise HookrunError(
                "dry_run: true with features: the job writes no rows to size; valid: dry_run=false"
            )
        done = run_features(spec, config, ctx)
        if done.rank != 0:
            return JobResult(done.path, f"features: rank {done.rank}'s rows done")
        with h5py.File(done.path, "r") as f:
            lines = cls.summary(f, 0)
        if done.seconds:
            lines.append(f"time: {done.seconds:.1f} s, {done.rows / done.seconds:.1f} rows/s")
        return JobResult(done.path, "\n".join(lines))

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        if not is_features_file(f):
            return []
        lines = [f"features: {f.filename} ({attr(f, 'rows')} rows, {attr(f, 'status')})"]
        for module, site in feature_sites(f):
            g = f[site_group(module, site)]
            density = g["density"][()]
            alive = int((density > 0).sum())
            lines.append(
                f"  {module}:{site}: {attr(g, 'units')} units ({attr(g, 'kind')}), "
                f"{attr(g, 'tokens')} tokens, {alive} fired, median density "
                f"{float(np.median(density)):.3g}"
            )
        return lines

    @classmethod
    def damage(cls, f: h5py.File, complete: bool) -> list[str]:
        if not is_features_file(f):
            return []
        return damage(f, complete)
