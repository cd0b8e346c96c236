"""Resume: may an interrupted captures.h5 be continued by this config, and from which row?"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from hookrun.errors import HookrunError
from hookrun.io.layout import read_state

__all__ = ["RESUME_IGNORES", "resume_point"]

# Config keys that do not change a single number in the file: a resumed run may differ there.
RESUME_IGNORES = (
    "resume",
    "progress",
    "render",
    "render_max",
    "logger",
    "num_workers",
    "dry_run",
    "weights_path",
    "profile",
    "sink.overwrite",
    "sink.queue_depth",
    "sink.path",
    "model.preset",  # only guards model.name against another preset's weights (0.1 had none)
)


def _without(config: dict, keys: tuple[str, ...]) -> dict:
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for key in keys:
        head, _, tail = key.partition(".")
        if tail and isinstance(config.get(head), dict):
            config[head].pop(tail, None)
        elif not tail:
            config.pop(head, None)
    return config


def resume_point(path: Path, config_yaml: str) -> int:
    """Rows already complete in the captures.h5 a resumed run continues; HookrunError for a
    missing, foreign, complete or differently configured file."""
    if not path.is_file():
        raise HookrunError(
            f"resume: there is no {path} to resume; run without resume=true, or point "
            "hydra.run.dir (or sink.path) at the interrupted run"
        )
    try:
        state = read_state(path)
    except OSError as err:
        raise HookrunError(f"resume: {path} is not a readable HDF5 file ({err})") from None
    if state.config is None or state.status is None:
        raise HookrunError(f"resume: {path} was not written by hookrun (no config/status)")
    if state.status == "complete":
        raise HookrunError(
            f"resume: {path} is already complete ({state.completed} rows); nothing to do"
        )
    before = _without(OmegaConf.to_container(OmegaConf.create(state.config)), RESUME_IGNORES)
    now = _without(OmegaConf.to_container(OmegaConf.create(config_yaml)), RESUME_IGNORES)
    if before != now:
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        raise HookrunError(
            f"resume: the config differs from the one {path} was written with in "
            f"{', '.join(changed)}; resume with the same config, or start a new run"
        )
    return state.completed
