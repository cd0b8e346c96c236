"""Step 3 of a run, finish: the shards joined, the whole-run work, the pictures, the summary.

The torchrun shards are joined; each stage's whole-run work runs once every row is in the
file (which is complete only then); the pictures are drawn from it; and the summary says
the file, pictures, top-1 classes, each stage's lines and the throughput.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hookrun.config.build import RunSpec
from hookrun.data import token_cache
from hookrun.errors import RunFault, first_line
from hookrun.io.results import Results, summary
from hookrun.io.whole_run import finishing, pending_of, write_whole_run, written_values
from hookrun.models.adapter import adapt
from hookrun.models.sources import class_names
from hookrun.pipeline.claim import MEMORY, Claim, images_dir
from hookrun.pipeline.prepare import Prepared
from hookrun.scale import distributed
from hookrun.scale.distributed import World
from hookrun.signals import deferred, interruptible
from hookrun.stage import completed, summarised

__all__ = ["Result", "finish", "dry_result"]

log = logging.getLogger("hookrun")


@dataclass
class Result:
    """What a run produced: `hookrun.run` returns it; `open()` reads its file.

    Attributes:
        path: The captures.h5; None for a dry run, or a sink.path=memory run.
        run_dir: The run's folder (pictures, logs, the inline dataset).
        rows: The rows in the file (a torchrun rank other than 0: those it computed).
        plan_text: The plan, as the dry run prints it.
        seconds: How long the run took.
        summary: The end-of-run text, as the CLI logs it.
        images: The pictures' folder; None when none were drawn (render=false).
        profile: Seconds per stage (profile=true), else None.
        memory: The file's bytes of a sink.path=memory run (`path` is None), else None.
    """

    path: Path | None
    run_dir: Path
    rows: int
    plan_text: str
    seconds: float
    summary: str = ""
    images: Path | None = None
    profile: dict[str, float] | None = field(default=None)  # seconds per stage (profile=true)
    memory: bytes | None = None  # sink.path=memory: the file itself (`path` is None)

    def open(self) -> Results:
        """The captures.h5 opened read-only: `with result.open() as res: ...`.

        Returns:
            The file as `Results` (from memory for a sink.path=memory run).

        Raises:
            ValueError: A dry run, which writes no file.
            OSError: The file is gone or unreadable.
        """
        if self.memory is not None:
            return Results(self.memory)
        if self.path is None:
            raise ValueError("a dry run writes no captures.h5")
        return Results(self.path)


def dry_result(run: Prepared) -> Result:
    """`dry_run=true`: the plan printed, nothing written.

    Args:
        run: The prepared run.

    Returns:
        A Result with no file.
    """
    print(run.plan_text)
    print("dry run: nothing written")
    seconds = time.perf_counter() - run.started
    return Result(None, run.run_dir, 0, run.plan_text, seconds, summary="dry run: nothing written")


def _draw(spec: RunSpec, path: Path, run_dir: Path, plan_text: str) -> Path | None:
    """The run's pictures from its complete file (render=true).

    Their folder, or None when nothing was drawable.
    """
    if not spec.render:
        return None
    # Imported here: matplotlib costs a run that draws nothing 0.2-0.3 s of start-up.
    from hookrun.render.draw import render

    images = images_dir(spec, run_dir)
    tensorboard = run_dir / "tensorboard" if spec.logger == "tensorboard" else None
    with interruptible():  # every picture is written whole (renamed into place) or not
        return images if render(path, images, spec.render_max, tensorboard, plan_text) else None


def _draw_missing(spec: RunSpec, path: Path, run_dir: Path) -> tuple[Path | None, int]:
    """The pictures of a complete file that its folder lacks, drawn aside and moved in.

    For a run stopped while drawing them; those already there are left as they are. The
    folder and how many were added.
    """
    if not spec.render:
        return None, 0
    from hookrun.render.draw import render

    images = images_dir(spec, run_dir)
    images.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{images.name}.", dir=images.parent))
    added = 0
    try:
        with interruptible():
            render(path, scratch, spec.render_max)
        for picture in sorted(scratch.glob("*.png")):
            target = images / picture.name
            if not target.exists():
                images.mkdir(exist_ok=True)
                os.replace(picture, target)  # the same file system: whole or not at all
                added += 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return (images if images.is_dir() else None), added


def already_complete(
    spec: RunSpec, claim: Claim, run_dir: Path, caller_model: Any, world: World
) -> Result:
    """resume=true on a file that is complete: nothing computed, the missing pictures drawn.

    A requeued job killed after its last row, or while drawing: every dataset is left as it
    is, the missing pictures drawn (by rank 0 under torchrun); exit status 0.

    Args:
        spec: The run's spec.
        claim: The run's claim on its file.
        run_dir: The run's folder.
        caller_model: A caller's model, for its class names, or None.
        world: The torchrun world.

    Returns:
        The Result, its summary saying nothing was computed.
    """
    started = time.perf_counter()
    path = claim.final_path
    if world.rank != 0:
        return Result(path, run_dir, 0, "", time.perf_counter() - started)
    images, added = _draw_missing(spec, path, run_dir)
    drew = f"; drew {added} missing picture{'s' * (added != 1)}" if spec.render else ""
    said = (
        f"resume: {path} is already complete ({claim.resumed.rows} rows): nothing computed, "
        f"every dataset left as it was{drew}"
    )
    log.warning("%s", said)
    names = class_names(spec.model) or adapt(caller_model).output_names()
    seconds = time.perf_counter() - started
    text = said + "\n" + summary(path, seconds, names, images, computed=0, more=summarised)
    log.info("\n%s", text)
    return Result(path, run_dir, claim.resumed.rows, "", seconds, summary=text, images=images)


def _every_shard_complete() -> None:
    """Wait until every rank's shard is complete, before rank 0 joins them.

    A signal stops the wait: a blocking barrier is one call into gloo that no handler
    interrupts, and a rank whose shard was complete waited there for the others however it
    was told to stop. A process of the job that ended meanwhile is said in one line.
    """
    work = torch.distributed.barrier(async_op=True)
    with interruptible():
        while not work.is_completed():
            time.sleep(0.05)  # a caught signal raises here, in the interruptible region
    try:
        work.wait()
    except RuntimeError as err:
        raise RunFault(
            f"torchrun: another process of the job ended before every shard was complete "
            f"({first_line(err)}); this process's shard is kept: run the same command with "
            "resume=true"
        ) from None


def _whole_run(run: Prepared, path: Path) -> list[str]:
    """Each stage's whole-run work still pending in the complete rows' file, written into it.

    All of it in a new run; in a resumed one only what a kill left unwritten. The file is
    then marked complete (io/whole_run.py). The stages that computed.
    """
    if not run.finishes:
        return []
    done = []
    with finishing(path, run.finishes, run.spec.sink.checksum) as f:
        for name, plan in run.stages.items():
            keys = list(plan.finishes())
            if not keys or not pending_of(f, keys):
                continue  # none, or written before the kill a resume continues
            with run.timer.stage(name), interruptible():
                values = plan.finish(f)
            with deferred():  # the values and their marks, whole
                write_whole_run(f, {key: values[key] for key in keys})
            done.append(name)
    return done


def finish(run: Prepared, rows_here: int) -> Result:
    """After the last batch: the shards joined, whole-run work, pictures and summary.

    Rank 0 joins the shards and does the rest; every other rank returns its shard's Result.

    Args:
        run: The prepared run.
        rows_here: The rows this process computed.

    Returns:
        The run's Result.

    Raises:
        RunFault: Another process of a torchrun job ended before every shard was complete.
    """
    spec, world = run.spec, run.world
    total = len(run.data)
    path = run.claim.final_path
    if world.parallel:
        _every_shard_complete()
        if world.rank != 0:
            seconds = time.perf_counter() - run.started
            return Result(run.claim.sink_path, run.run_dir, rows_here, run.plan_text, seconds)
        # A resume joins the shards again (virtual datasets: no rows are copied), keeping
        # the whole-run results an earlier join holds written (a kill during that work).
        kept = written_values(path, list(run.finishes)) if spec.resume else {}
        with interruptible():  # made under another name: stopped anywhere, nothing is lost
            distributed.merge_shards(
                path,
                world,
                total,
                spec.batch_size,
                run.header,
                replace=spec.sink.overwrite or spec.resume,
                summaries=completed,
                finishes=run.finishes,
                attrs=run.attrs,
                written=kept,
            )
    finished = _whole_run(run, path)
    if spec.resume and finished:
        log.warning("resume: computed the whole-run results of %s", ", ".join(finished))
    token_cache.remove(run.run_dir)  # complete: no rank or resume needs the ids again
    images = _draw(spec, path, run.run_dir, run.plan_text)
    seconds = time.perf_counter() - run.started
    computed = rows_here if spec.resume or world.parallel else None
    # A language model's output columns are its vocabulary: the summary shows the tokens.
    names = class_names(spec.model) or adapt(run.model).output_names()
    shown = MEMORY if run.claim.scratch is not None else None
    text = summary(path, seconds, names, images, computed=computed, more=summarised, name=shown)
    if spec.profile:
        text += "\n" + run.timer.report(seconds)
    log.info("\n%s", text)
    return Result(
        path,
        run.run_dir,
        total,
        run.plan_text,
        seconds,
        summary=text,
        images=images,
        profile=dict(run.timer.seconds),
    )
