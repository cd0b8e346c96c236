"""A training job's checkpoint: one file, <run dir>/checkpoints/train_state.pt, replaced whole.

It holds every trainer's state (weights, optimiser, schedule, counters), the data's
position, the normalisation factors and the curves so far: all a resumed job needs to
repeat the steps after it exactly. It is replaced whole (io/whole_file.py), so a kill at any
moment leaves the old checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from hookrun.errors import HookrunError
from hookrun.io.resume import config_changes
from hookrun.io.whole_file import replaced_whole

__all__ = ["path_of", "save", "load", "resumed", "remove"]

FOLDER = "checkpoints"
NAME = "train_state.pt"


def path_of(run_dir: Path, name: str = NAME) -> Path:
    """The checkpoint `name` of the run (a job of another stage names its own)."""
    return run_dir / FOLDER / name


def save(run_dir: Path, state: dict[str, Any], name: str = NAME) -> None:
    """`state` as the run's checkpoint, replacing the one before only once it is on disk."""
    with replaced_whole(path_of(run_dir, name)) as temp:
        torch.save(state, temp)


def load(run_dir: Path, name: str = NAME) -> dict[str, Any] | None:
    """The run's checkpoint, or None where it has none.

    Raises:
        HookrunError: a checkpoint that cannot be read (named, with what to do).
    """
    path = path_of(run_dir, name)
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file: torch raises many kinds
        raise HookrunError(
            f"resume: {path} cannot be read ({type(err).__name__}: {err}); valid: remove it to "
            "start again from the beginning, or a new run dir"
        ) from None


def resumed(run_dir: Path, config_yaml: str, name: str = NAME) -> dict[str, Any] | None:
    """The checkpoint `name` a resume continues from (None: there is none), refused when it
    was written under another config.

    Raises:
        HookrunError: the config differs (the keys named), or the checkpoint is unreadable.
    """
    saved = load(run_dir, name)
    if saved is None:
        return None
    changed = config_changes(saved["config"], config_yaml)
    if changed:
        raise HookrunError(
            f"resume: the config differs from the one {path_of(run_dir, name)} was written "
            f"with in {', '.join(changed)}; resume with the same config, or start a new run"
        )
    return saved


def remove(run_dir: Path) -> None:
    """The checkpoints of a finished (or overwritten) job, and any partial one."""
    shutil.rmtree(run_dir / FOLDER, ignore_errors=True)
