"""The optional extras (pyproject.toml's [project.optional-dependencies]) and the one-line
error for a missing one: what asked for it, the extra, the pip command (and, where there is
one, what works without it), e.g. `logger=tensorboard needs the tensorboard extra: pip install
'hookrun[tensorboard]'`. A default run (`hookrun`) imports none of them."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from hookrun.errors import HookrunError

__all__ = ["missing_extra", "require_extra", "refuse_missing_launcher"]

# hydra/launcher=... options and the Hydra plugin each needs (both in the launchers extra);
# slurm and slurm_cpu are hookrun's (conf/hydra/launcher/), on top of submitit_slurm.
_LAUNCHERS = {
    "joblib": "hydra_plugins.hydra_joblib_launcher",
    "slurm": "hydra_plugins.hydra_submitit_launcher",
    "slurm_cpu": "hydra_plugins.hydra_submitit_launcher",
    "submitit_slurm": "hydra_plugins.hydra_submitit_launcher",
    "submitit_local": "hydra_plugins.hydra_submitit_launcher",
}


def missing_extra(what: str, extra: str, instead: str = "") -> HookrunError:
    """The error for `what` (a key and its value, as the user typed it) without `extra`."""
    tail = f" (or {instead})" if instead else ""
    return HookrunError(f"{what} needs the {extra} extra: pip install 'hookrun[{extra}]'{tail}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or sys.modules[name] = None
        return False


def require_extra(modules: Sequence[str], what: str, extra: str, instead: str = "") -> None:
    """Raise missing_extra unless every one of `modules` can be imported."""
    if not all(_installed(m) for m in modules):
        raise missing_extra(what, extra, instead)


def refuse_missing_launcher(overrides: Sequence[str]) -> None:
    """Before Hydra composes (its own refusal is "Could not find 'hydra/launcher/joblib'" and
    a list of what is there): hydra/launcher=joblib|slurm|slurm_cpu|submitit_* without the
    launchers extra, in one line."""
    for given in overrides:
        key, sep, value = given.partition("=")
        if not sep or key.lstrip("+~") != "hydra/launcher":
            continue
        for choice in value.split(","):
            module = _LAUNCHERS.get(choice.strip())
            if module is not None and not _installed(module):
                raise missing_extra(f"hydra/launcher={choice.strip()}", "launchers")
