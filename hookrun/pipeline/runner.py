"""One run, in three steps: claim the file, prepare → stream → finish (the CLI and
`hookrun.run` both end here). Under torchrun every rank runs its share of the batches and
rank 0 joins them."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hookrun.config.build import RunSpec
from hookrun.errors import Interrupted
from hookrun.io.layout import Provenance, read_state
from hookrun.models.adapter import adapt
from hookrun.pipeline.claim import Claim, claim_file, images_dir
from hookrun.pipeline.device import devices_kept, resolve_device
from hookrun.pipeline.finish import Result, already_complete, dry_result, finish
from hookrun.pipeline.prepare import CallerObjects, model_and_data, prepare
from hookrun.pipeline.stream import stream
from hookrun.runtime.hooks import hooks_kept, weights_kept
from hookrun.scale import distributed
from hookrun.scale.distributed import World, world_from_env
from hookrun.scale.provenance import provenance, reproducible
from hookrun.signals import signals_caught, stop_if_signalled
from hookrun.stage import JobContext, stages

__all__ = ["execute"]

log = logging.getLogger("hookrun")


def _left(claim: Claim) -> str:
    """What an interrupted run left: no file, a file marked interrupted, or a complete one
    (stopped while drawing its pictures)."""
    path = claim.sink_path
    try:
        state = read_state(path) if path.is_file() else None
    except OSError:
        state = None
    if state is None:
        return f"nothing written ({path} was not made)"
    if state.status == "complete":
        return f"{path} is complete; resume=true draws the pictures it lacks"
    return (
        f"{path} holds {state.completed} complete rows and is marked {state.status}; "
        "continue it with resume=true"
    )


def execute(spec: RunSpec, run_dir: Path, caller: CallerObjects | None = None) -> Result:
    """Run `spec`; captures go to `run_dir`/captures.h5 unless `sink.path` says otherwise.
    A caller's model leaves exactly as it came (hooks, flags, devices)."""
    caller = caller or CallerObjects()
    world = world_from_env()
    device = resolve_device(spec.device, world)
    result = _execute(spec, run_dir, caller, world, device)
    # Taken down only after a whole run: destroying the group waits for every rank, and a
    # rank a signal or an error stopped would wait there for a peer that may never come
    # (the process's exit releases it).
    distributed.stop()
    return result


def _job(
    spec: RunSpec, run_dir: Path, caller: CallerObjects, world: World, device: torch.device
) -> Result | None:
    """The job of a stage that runs one of its own instead of the rows' pipeline (Stage.job),
    as a Result; None when no stage does."""
    started = time.perf_counter()

    def load(other: RunSpec) -> tuple:
        return model_and_data(other, caller, device, run_dir)

    def run_other(
        other: RunSpec, other_dir: Path, model: Any = None, weights_file: Path | None = None
    ) -> Result:
        if model is None or caller.model is not None:  # the caller's model, if any
            return _execute(other, other_dir, CallerObjects(caller.model), world, device)
        # the job's own model, built from the config: the run uses it as it would build it
        lent = CallerObjects(model, lent_from=weights_file, lent=True)
        return _execute(other, other_dir, lent, world, device)

    def header(other: RunSpec, weights_file: Path | None) -> Provenance:
        return provenance(other, weights_file, device, world.size)

    ctx = JobContext(
        run_dir, device, caller.model, load, run_other, header, images_dir(spec, run_dir)
    )
    for stage in stages():
        config = spec.stage(stage.node) if stage.node else None
        if config is None:
            continue
        done = stage.job(config, spec, ctx)
        if done is not None:
            log.info("\n%s", done.summary)
            return Result(
                path=done.path,
                run_dir=run_dir,
                rows=done.rows,
                plan_text="",
                seconds=time.perf_counter() - started,
                summary=done.summary,
                images=done.images,
            )
    return None


def _execute(
    spec: RunSpec, run_dir: Path, caller: CallerObjects, world: World, device: torch.device
) -> Result:
    if world.parallel:
        run_dir = distributed.start(world, device, run_dir)
    # A stage that changes weights (randomises them): a caller's model gets its own back,
    # bit for bit.
    randomised = caller.model is not None and any(
        s.changes_weights and spec.stage(s.node) is not None for s in stages() if s.node
    )
    with (
        reproducible(spec.seed, spec.deterministic),
        devices_kept(caller.model),
        hooks_kept(caller.model),  # under every registration: none stays on the model
        adapt(caller.model).attention_kept(),  # at: pattern may switch attention to eager
        weights_kept(caller.model) if randomised else nullcontext(),
        signals_caught(),
    ):
        job = _job(spec, run_dir, caller, world, device)
        if job is not None:
            return job
        claim = claim_file(spec, run_dir, world)
        try:
            if claim.resumed.complete:  # a requeued job that had finished
                return already_complete(spec, claim, run_dir, caller.model, world)
            run = prepare(spec, run_dir, world, device, caller, claim)
            if spec.dry_run:
                return dry_result(run)
            stop_if_signalled()  # a signal during start-up: stop before any file exists
            if world.rank == 0:
                log.info("\n%s", run.plan_text)
            rows_here = stream(run)
            result = finish(run, rows_here)
            # sink.path=memory: the file's bytes in the result, the file removed below.
            return claim.kept(lambda image: replace(result, path=None, memory=image), result)
        except Interrupted as err:
            raise Interrupted(f"{err}: {_left(claim)}", err.signum) from None
        finally:
            claim.release()  # the writer lock, held since the path checks
