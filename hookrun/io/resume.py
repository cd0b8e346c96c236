"""Resume: may an interrupted captures.h5 be continued by this config, and from which row?"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from hookrun.errors import HookrunError, first_line
from hookrun.io.layout import (
    SAMPLES_INDEX,
    SPARSE_COUNTS,
    Provenance,
    dataset_names,
    is_pending,
    read_paths,
    read_provenance,
    read_state,
    rows_for,
    sparse_part,
)
from hookrun.io.storage import never_written, open_readonly, unreadable_rows

__all__ = [
    "RESUME_IGNORES",
    "config_changes",
    "Resumed",
    "resume_point",
    "check_sources",
    "check_paths",
]

log = logging.getLogger("hookrun")

# What the config cannot say but changes the bytes: the weights' and the source files'
# contents, the number of shards, the library that computes the numbers.
_SOURCES = {
    "weights_sha256": "model.weights",
    "data_files_sha256": "dataset files (path, size, label)",
    "world_size": "the number of processes (world size)",
    "torch_version": "torch version",
    "patch_sources": "the files the run reads",
}

# Config keys that do not change a single number in the file: a resumed run may differ there.
RESUME_IGNORES = (
    "resume",
    "progress",
    "render",
    "render_max",
    "render_style",
    "logger",
    "num_workers",
    "dry_run",
    "weights_path",
    "profile",
    "sink.overwrite",
    "sink.queue_depth",
    "sink.path",
    "sink.checksum",  # a resumed file keeps the filters its datasets were created with
    "model.preset",  # only guards a preset's name; files from before it have no such key
    "evaluate.rank_by",  # what a sweep ranks by, read after the run
)


def _without(config: dict, keys: tuple[str, ...]) -> dict:
    # An empty section is a feature left off: a file written before the section existed
    # (evaluate and sanity came after 0.1.0) has the same config as one that leaves it empty.
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items() if v != {}}
    for key in keys:
        head, _, tail = key.partition(".")
        if tail and isinstance(config.get(head), dict):
            config[head].pop(tail, None)
        elif not tail:
            config.pop(head, None)
    return config


def config_changes(before_yaml: str, now_yaml: str) -> list[str]:
    """The top-level keys whose values differ between two resolved configs, leaving out
    those that change no number (RESUME_IGNORES); [] when a resume may continue."""
    before = _without(OmegaConf.to_container(OmegaConf.create(before_yaml)), RESUME_IGNORES)
    now = _without(OmegaConf.to_container(OmegaConf.create(now_yaml)), RESUME_IGNORES)
    if before == now and list(before.get("hooks") or {}) != list(now.get("hooks") or {}):
        # Hooks at one site act in the order they are written: the same hooks reordered
        # compute other numbers.
        return ["hooks (their order)"]
    return sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run starts: the rows already complete in its file, and whether the
    whole file is (a requeued job that had finished: nothing to compute)."""

    rows: int = 0
    complete: bool = False


def resume_point(path: Path, config_yaml: str) -> Resumed:
    """Where a resumed run continues the captures.h5 at `path` (0 rows: none yet, the run
    starts it, or starts it over; a complete file: every row, nothing to compute, resuming
    is idempotent); HookrunError for a cut, foreign, damaged or differently configured
    file."""
    if not path.exists():
        # A requeued job killed before its file existed: nothing to continue, so start.
        log.warning("resume: there is no %s yet; starting it", path)
        return Resumed()
    try:
        state = read_state(path)
    except OSError as err:
        if never_written(err):  # killed before its first row: nothing in it to keep
            log.warning("resume: %s was stopped before its first row; starting it over", path)
            return Resumed()
        raise HookrunError(f"resume: {path} is not a readable HDF5 file ({err})") from None
    except (KeyError, RuntimeError, ValueError) as err:  # HDF5 read damaged metadata
        raise HookrunError(
            f"resume refused: {path} is damaged (its metadata cannot be read: "
            f"{first_line(err)}); start a new run"
        ) from None
    if state.config is None or state.status is None:
        raise HookrunError(f"resume: {path} was not written by hookrun (no config/status)")
    changed = config_changes(state.config, config_yaml)
    if changed:
        raise HookrunError(
            f"resume: the config differs from the one {path} was written with in "
            f"{', '.join(changed)}; resume with the same config, or start a new run"
        )
    if state.status == "complete":
        # Nothing will be written to it (python -m hookrun.verify reads every chunk).
        return Resumed(state.completed, complete=True)
    _refuse_damage(path, state.completed)
    return Resumed(state.completed)


def _refuse_damage(path: Path, completed: int) -> None:
    """Refuse a file whose completed rows do not all read back (a chunk failing its
    checksum): continued, it would end `complete` holding rows nobody can read."""
    try:
        with open_readonly(path) as f:
            for name in dataset_names(f):
                if is_pending(f[name]):
                    continue  # a whole-run result not written yet: computed again
                # A killed writer's sparse entries may end in a torn chunk, which io/stored.py
                # `rewrite_rows` reads past its checksum: no damage to the counted entries.
                torn = sparse_part(f[name]) not in (None, SPARSE_COUNTS)
                reason = unreadable_rows(f[name], rows_for(f[name], completed), torn)
                if reason:
                    raise HookrunError(
                        f"resume refused: {path} is damaged ({reason}); python -m "
                        f"hookrun.verify {path} lists the damage; start a new run"
                    )
    except (OSError, KeyError, RuntimeError, ValueError) as err:
        raise HookrunError(
            f"resume refused: {path} is damaged ({first_line(err)}); start a new run"
        ) from None


def _short(value: str) -> str:
    return f"{value[:8]}…" if len(value) > 12 else value or "none"


def check_sources(path: Path, now: Provenance) -> None:
    """Refuse to continue a file whose rows came from other weights, other source files, a
    different world size or torch version: the continued rows would not match."""
    if not path.is_file():
        return
    try:
        before = read_provenance(path)
    except OSError:
        return  # never written: resume_point let it start over
    now_values = {k: str(v) for k, v in dataclasses.asdict(now).items()}
    for key, what in _SOURCES.items():
        if key in before and before[key] != now_values[key]:
            old, new = before[key], now_values[key]
            if key == "patch_sources":
                what, old, new = _changed_source(old, new)
            elif key.endswith("sha256"):
                old, new = f"sha256 {_short(old)}", f"sha256 {_short(new)}"
            raise HookrunError(
                f"resume refused: {what} changed ({old} → {new}) since {path} was started; "
                "restore it, or start a new run"
            )


def _changed_source(before: str, now: str) -> tuple[str, str, str]:
    """Which file the run reads changed (its config key), and how: (what, old, new)."""
    try:
        old, new = json.loads(before or "{}"), json.loads(now or "{}")
    except ValueError:
        return "the files the run reads", _short(before), _short(now)
    for key in sorted(set(old) | set(new)):
        was, is_now = old.get(key, {}), new.get(key, {})
        if was != is_now:

            def said(read: dict) -> str:
                return f"{read['file']} sha256 {_short(read['sha256'])}" if read else "none"

            return f"the file {key} reads", said(was), said(is_now)
    return "the files the run reads", _short(before), _short(now)


def check_paths(path: Path, files: Mapping[int, str]) -> None:
    """Refuse to continue a file whose rows name other source files than those rows would
    now (`files`: dataset index → absolute path), as when a relative dataset.root is
    resolved from another directory: the file would mix two sets of paths."""
    with open_readonly(path) as f:
        stored = read_paths(f)
        if stored is None:
            return
        index = f[SAMPLES_INDEX][: len(stored)]
    for row, (i, before) in enumerate(zip(index, stored, strict=True)):
        now = files.get(int(i), "(no such row now)")
        if now != before:
            raise HookrunError(
                f"resume refused: row {row} was read from {before}, which is now {now} "
                f"(a relative dataset.root read from another directory?); resume from the "
                "directory the run started in or with an absolute dataset.root, or start a new run"
            )
