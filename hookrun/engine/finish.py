"""Stage 3 of a run — finish: join torchrun shards, draw the pictures from the finished
file, and summarise (file, pictures, top-1 classes, throughput)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hookrun.engine.prepare import Prepared
from hookrun.io.results import Results, summary
from hookrun.methods.induction import induction_of_run
from hookrun.models.sources import class_names
from hookrun.scale import distributed

__all__ = ["Result", "finish", "dry_result"]

log = logging.getLogger("hookrun")


@dataclass
class Result:
    """What a run produced. `path` is the captures.h5 (None for a dry run); `open()` reads it."""

    path: Path | None
    run_dir: Path
    rows: int
    plan_text: str
    seconds: float
    summary: str = ""
    images: Path | None = None
    profile: dict[str, float] | None = field(default=None)  # seconds per stage (profile=true)

    def open(self) -> Results:
        """The captures.h5 opened read-only (`with result.open() as res: ...`)."""
        if self.path is None:
            raise ValueError("a dry run writes no captures.h5")
        return Results(self.path)


def dry_result(run: Prepared) -> Result:
    """`dry_run=true`: the plan printed, nothing written."""
    print(run.plan_text)
    print("dry run: nothing written")
    seconds = time.perf_counter() - run.started
    return Result(None, run.run_dir, 0, run.plan_text, seconds, summary="dry run: nothing written")


def finish(run: Prepared, rows_here: int) -> Result:
    """After the last batch: rank 0 joins the shards, then pictures and summary."""
    spec, world = run.spec, run.world
    total = len(run.data)
    if world.parallel:
        torch.distributed.barrier()  # every shard is complete before rank 0 reads them
        if world.rank != 0:
            seconds = time.perf_counter() - run.started
            return Result(run.sink_path, run.run_dir, rows_here, run.plan_text, seconds)
        replace = spec.sink.overwrite or spec.resume  # a resumed run may redo an interrupted merge
        distributed.merge_shards(run.final_path, world, total, spec.batch_size, run.header, replace)
    # experiment=induction: the scores per head, from the complete file's patterns.
    induction_of_run(run.final_path, spec.dataset, run.plan, run.model)
    images = None
    if spec.render:
        # Imported here: matplotlib costs a run that draws nothing 0.2-0.3 s of start-up.
        from hookrun.render.draw import render

        images = run.run_dir / "images" / (spec.experiment or "run")
        tensorboard = run.run_dir / "tensorboard" if spec.logger == "tensorboard" else None
        if not render(run.final_path, images, spec.render_max, tensorboard, run.plan_text):
            images = None
    seconds = time.perf_counter() - run.started
    computed = rows_here if spec.resume or world.parallel else None
    # A language model's output columns are its vocabulary: the summary shows the tokens.
    names = class_names(spec.model) or getattr(run.model, "output_names", lambda: None)()
    text = summary(run.final_path, seconds, names, images, computed=computed)
    if spec.profile:
        text += "\n" + run.timer.report(seconds)
    log.info("\n%s", text)
    return Result(
        run.final_path,
        run.run_dir,
        total,
        run.plan_text,
        seconds,
        summary=text,
        images=images,
        profile=dict(run.timer.seconds),
    )
