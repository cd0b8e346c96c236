"""The `train_sae` stage: the `sae:` node parsed, and the training job run instead of the
rows' pipeline (Stage.job); the summary, pictures, sweep columns and damage of its file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import h5py

from hookrun.errors import HookrunError
from hookrun.io.layout import attr
from hookrun.stage import JobContext, JobResult, ParseContext, Stage, register_stage
from hookrun.training import runfile
from hookrun.training.config import HeldoutConfig, TrainConfig, TrainJob, parse_train

__all__ = ["TrainStage"]

# The final curve row's numbers the summary says.
_SAID = ("loss", "mse", "explained_variance", "l0", "dead")


@register_stage
class TrainStage(Stage):
    name = "train_sae"
    node = "sae"
    order = 5
    axes = {"train/*/curves": "step field", "train/*/scores": "field"}

    @classmethod
    def schema(cls) -> dict[str, type]:
        return {"sae": TrainConfig, "sae.heldout": HeldoutConfig}

    @classmethod
    def parse(cls, raw: Any, ctx: ParseContext) -> TrainJob | None:
        job = parse_train(raw)
        if job is not None and ctx.target.kind.value != "none":
            raise HookrunError(
                f"target.kind: {ctx.target.kind.value!r} with sae.sites: training runs no "
                "backward pass of the model; valid: none"
            )
        return job

    @classmethod
    def job(cls, config: TrainJob, spec: Any, ctx: JobContext) -> JobResult:
        from hookrun.stages.train.scoring import scorer
        from hookrun.training.job import train

        if spec.dry_run:
            raise HookrunError(
                "dry_run: true with sae.sites: a training job writes no rows to size; valid: "
                "dry_run=false"
            )
        score = scorer(spec, ctx, config.config.heldout.rows)
        trained = train(spec, config, ctx, score)
        images = None
        with h5py.File(trained.path, "r") as f:
            lines = cls.summary(f, 0)
            if spec.render and trained.main:  # under torchrun: rank 0's pictures
                from hookrun.stages.train.draw import render_curves

                images = ctx.images
                drawn = render_curves(runfile.read(f), images)
                lines.append(f"pictures: {images} ({len(drawn)} files)")
        if trained.tokens_per_second:
            lines.append(f"training: {trained.tokens_per_second:,.0f} tokens/s")
        return JobResult(trained.path, "\n".join(lines), images)

    @classmethod
    def summary(cls, f: h5py.File, rows: int) -> list[str]:
        if not runfile.is_training_file(f):
            return []
        step, steps, status = (attr(f, k) for k in ("step", "steps", "status"))
        lines = [f"trained: {f.filename} ({step} of {steps} steps, {status})"]
        for d in runfile.read(f):
            curves = d["curves"]
            last = {k: float(v[-1]) for k, v in curves.items()} if curves else {}
            said = ", ".join(f"{k} {last[k]:.4g}" for k in _SAID if k in last)
            lines.append(f"  {d['name']}: {said}")
            scores = d["scores"] or {}
            held = ", ".join(
                f"{k} {scores[k]:.4g}"
                for k in ("l0", "explained_variance", "ce_loss_score", "kl_div_score", "dead")
                if k in scores and math.isfinite(scores[k])
            )
            if held:
                lines.append(f"    held out: {held}")
            if d.get("folder"):
                lines.append(f"    saved: {d['folder']}")
        return lines

    @classmethod
    def columns(cls, f: h5py.File, rows: int) -> dict[str, float]:
        # Named as the scores stage names a spliced site's (sae:<site>:<score>), a
        # dictionary's name for its site: its sweep ranking and L0 / CE-loss picture
        # (sae_ranking.*) rank trained dictionaries too.
        if not runfile.is_training_file(f):
            return {}
        out = {}
        for d in runfile.read(f):
            for name, value in (d["scores"] or {}).items():
                if math.isfinite(value):
                    out[f"sae:{d['name']}:{name}"] = value
        return out

    @classmethod
    def damage(cls, f: h5py.File, complete: bool) -> list[str]:
        if not runfile.is_training_file(f):
            return []
        return runfile.damage(f, complete)

    @classmethod
    def draw(cls, f: h5py.File, out_dir: Path, rows: int, config: dict) -> list[Path]:
        if not runfile.is_training_file(f):
            return []
        from hookrun.stages.train.draw import render_curves

        return render_curves(runfile.read(f), out_dir)
