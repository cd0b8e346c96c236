"""The file a run writes, claimed before anything else: its path (a torchrun rank's shard),
the writer lock held to the end of the run, the paths refused that exist or cannot be
written, and where a resumed run starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from hookrun.config.build import RunSpec
from hookrun.errors import HookrunError
from hookrun.io.lock import WriterLock
from hookrun.io.resume import Resumed, resume_point
from hookrun.io.sink import check_sink_path
from hookrun.scale import distributed
from hookrun.scale.distributed import World
from hookrun.signals import interruptible

__all__ = ["Claim", "claim_file", "images_dir"]


@dataclass
class Claim:
    """The file a run writes, claimed before anything else: its paths, the writer lock (held
    to the end of the run), and where a resumed run starts."""

    final_path: Path  # the captures.h5 users read
    sink_path: Path  # the file this process writes (a shard under torchrun)
    lock: WriterLock | None = None
    resumed: Resumed = field(default_factory=Resumed)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def claim_file(spec: RunSpec, run_dir: Path, world: World) -> Claim:
    """The run's file, locked and checked: a path that exists (unless resumed or
    overwritten) or cannot be written is refused, a resumed file's rows are counted."""
    if spec.sink.path and spec.sink.path.endswith(("/", os.sep)):
        raise HookrunError(
            f"sink.path: {spec.sink.path} ends with '/', which names a folder; valid: a file "
            f"path, e.g. {spec.sink.path}captures.h5"
        )
    final_path = Path(spec.sink.path).expanduser() if spec.sink.path else run_dir / "captures.h5"
    if final_path.is_symlink() and final_path.exists():
        # Through a link the file it names is the one written and locked: two names of one
        # file must not give two writers, and the link itself stays a link.
        final_path = Path(os.path.realpath(final_path))
    sink_path = distributed.shard_path(final_path, world) if world.parallel else final_path
    # The lock first: the checks below then cannot race another run on the same file.
    claim = Claim(final_path, sink_path, None if spec.dry_run else WriterLock(sink_path))
    try:
        with interruptible():  # a resume's damage check reads the whole file
            claim.resumed = _check_paths(spec, final_path, sink_path, world, run_dir)
    except BaseException:
        claim.release()
        raise
    return claim


def images_dir(spec: RunSpec, run_dir: Path) -> Path:
    """Where a run's pictures go: <run dir>/images/<experiment>."""
    return run_dir / "images" / (spec.experiment or "run")


def _check_pictures(spec: RunSpec, run_dir: Path) -> None:
    """A new file's pictures would replace those of another run in the same folder (one run
    dir, another sink.path): refused unless sink.overwrite says replacing is wanted."""
    images = images_dir(spec, run_dir)
    if spec.render and not spec.sink.overwrite and images.is_dir() and any(images.iterdir()):
        raise HookrunError(
            f"render: {images} already holds the pictures of another run; valid: another "
            "hydra.run.dir, render=false, or sink.overwrite=true (replaces them)"
        )


def _check_paths(
    spec: RunSpec, final_path: Path, sink_path: Path, world: World, run_dir: Path
) -> Resumed:
    """Where a resumed run starts, after refusing paths that exist or cannot be written."""
    if spec.resume and world.parallel and final_path.exists():
        joined = resume_point(final_path, spec.config_yaml)
        if joined.complete:  # every shard was complete and joined: nothing to compute
            return joined
    if spec.resume and sink_path.exists():
        found = resume_point(sink_path, spec.config_yaml)
        # Under torchrun a shard may have finished before another rank was killed: its rows
        # are done, and the join still to come.
        return replace(found, complete=False) if world.parallel else found
    if spec.resume:
        sizes = distributed.shard_world_sizes(final_path) - {world.size}
        if sizes:
            raise HookrunError(
                f"resume refused: the number of processes changed ({min(sizes)} → "
                f"{world.size}) since {final_path} was started; resume with the same "
                "torchrun --nproc_per_node, or start a new run"
            )
        resume_point(sink_path, spec.config_yaml)  # says it starts the missing file
    if not spec.dry_run:
        check_sink_path(sink_path, spec.sink.overwrite)
        _check_pictures(spec, run_dir)
        if world.parallel and world.rank == 0:
            check_sink_path(final_path, spec.sink.overwrite)  # the file the shards will join in
    return Resumed()
