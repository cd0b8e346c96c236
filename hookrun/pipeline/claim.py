"""The file a run writes, claimed before anything else: its path (a torchrun rank's shard),
the writer lock held to the end of the run, the paths refused that exist or cannot be
written, and where a resumed run starts."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hookrun.config.build import RunSpec
from hookrun.errors import HookrunError, first_line
from hookrun.io.layout import read_state
from hookrun.io.lock import WriterLock
from hookrun.io.resume import Resumed, resume_point
from hookrun.io.sink import check_sink_path
from hookrun.scale import distributed
from hookrun.scale.distributed import World
from hookrun.signals import interruptible

__all__ = ["MEMORY", "Claim", "claim_file", "images_dir"]

# sink.path: memory keeps the file in the calling process (Result.open() reads it).
MEMORY = "memory"

log = logging.getLogger("hookrun")


@dataclass
class Claim:
    """The file a run writes, claimed before anything else: its paths, the writer lock (held
    to the end of the run), and where a resumed run starts."""

    final_path: Path  # the captures.h5 users read
    sink_path: Path  # the file this process writes (a shard under torchrun)
    lock: WriterLock | None = None
    resumed: Resumed = field(default_factory=Resumed)
    # sink.path=memory: the private folder the file is written in, read into the run's
    # Result at its end (`kept`) and removed with it.
    scratch: Path | None = None

    def kept(self, image: Callable[[bytes], Any], result: Any) -> Any:
        """The run's result; with sink.path=memory, `image(the file's bytes)` of it."""
        if self.scratch is None or not self.final_path.is_file():
            return result
        return image(self.final_path.read_bytes())

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
        if self.scratch is not None:  # a file in memory leaves nothing on disk
            shutil.rmtree(self.scratch, ignore_errors=True)


def claim_file(spec: RunSpec, run_dir: Path, world: World) -> Claim:
    """The run's file, locked and checked: a path that exists (unless resumed or
    overwritten) or cannot be written is refused, a resumed file's rows are counted."""
    if spec.sink.path and spec.sink.path.endswith(("/", os.sep)):
        raise HookrunError(
            f"sink.path: {spec.sink.path} ends with '/', which names a folder; valid: a file "
            f"path, e.g. {spec.sink.path}captures.h5"
        )
    scratch = _memory_scratch(spec, world) if spec.sink.path == MEMORY else None
    if scratch is not None:
        final_path = scratch / "captures.h5"
    elif spec.sink.path:
        final_path = Path(spec.sink.path).expanduser()
    else:
        final_path = run_dir / "captures.h5"
    if final_path.is_symlink() and final_path.exists():
        # Through a link the file it names is the one written and locked: two names of one
        # file must not give two writers, and the link itself stays a link.
        final_path = Path(os.path.realpath(final_path))
    sink_path = distributed.shard_path(final_path, world) if world.parallel else final_path
    # The lock first: the checks below then cannot race another run on the same file.
    lock = None if spec.dry_run else WriterLock(sink_path)
    claim = Claim(final_path, sink_path, lock, scratch=scratch)
    try:
        with interruptible():  # a resume's damage check reads the whole file
            claim.resumed = _check_paths(spec, final_path, sink_path, world, run_dir)
    except BaseException:
        claim.release()
        raise
    return claim


def _memory_scratch(spec: RunSpec, world: World) -> Path:
    """sink.path=memory: a private folder for the file while the run writes it (HDF5 needs
    a file to stream rows into with SWMR); refused where a file on disk is the point."""
    if spec.resume:
        raise HookrunError(
            "resume: true with sink.path: memory, whose file ends with the run that made "
            "it; valid: resume=false, or a sink.path on disk"
        )
    if world.parallel:
        raise HookrunError(
            f"sink.path: memory under torchrun ({world.size} processes), whose shards are "
            "joined through files; valid: a file path (the default <run dir>/captures.h5)"
        )
    return Path(tempfile.mkdtemp(prefix="hookrun-memory-"))


def _readable(joined: Path) -> bool:
    """Whether the join of a torchrun job's shards exists and reads. One that does not (an
    older hookrun made it in place, and a kill cut it short) holds nothing the shards do
    not: the resume joins them again, replacing it."""
    if not joined.exists():
        return False
    try:
        read_state(joined)
    except (OSError, KeyError, RuntimeError, ValueError) as err:
        log.warning(
            "resume: %s cannot be read (%s); the shards are joined again", joined, first_line(err)
        )
        return False
    return True


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
    if spec.resume and world.parallel and _readable(final_path):
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
