"""One run, in three steps: claim the file, prepare → stream → finish (the CLI and
`hookrun.run` both end here). Under torchrun every rank runs its share of the batches and
rank 0 joins them."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from hookrun.config.build import RunSpec
from hookrun.errors import Interrupted
from hookrun.io.layout import read_state
from hookrun.models.adapter import adapt
from hookrun.pipeline.claim import Claim, claim_file
from hookrun.pipeline.device import devices_kept, resolve_device
from hookrun.pipeline.finish import Result, already_complete, dry_result, finish
from hookrun.pipeline.prepare import CallerObjects, prepare
from hookrun.pipeline.stream import stream
from hookrun.runtime.hooks import hooks_kept, weights_kept
from hookrun.scale import distributed
from hookrun.scale.distributed import World, world_from_env
from hookrun.scale.provenance import reproducible
from hookrun.signals import signals_caught, stop_if_signalled
from hookrun.stage import stages

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
