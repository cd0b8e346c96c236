"""A config group set to null on the command line (`metrics=null`): Hydra stops there with
a ValueError and its traceback ("Config group override must be a string or a list"), which
names neither the group nor its options. Checked before Hydra composes, in one line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hookrun.errors import HookrunError

__all__ = ["refuse_null_groups"]


def _options(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def refuse_null_groups(overrides: Sequence[str], conf: Path) -> None:
    """HookrunError for the first override that sets a config group of `conf` (a folder of
    it: metrics, evaluate, model, ...) to null, alone or in a sweep; other overrides, and
    ones Hydra cannot parse (it says why itself) pass."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for given in overrides:
        if given.startswith("-"):  # -m, --cfg job, ...
            continue
        try:
            (override,) = parser.parse_overrides([given])
        except HydraException:  # not an override (a flag's value) or bad syntax
            continue
        group = override.key_or_group
        folder = conf / group
        if override.is_delete() or override.package is not None or not folder.is_dir():
            continue
        value = override.value()
        values = list(getattr(value, "list", None) or []) if override.is_sweep_override() else []
        if value is None or None in values:
            options = ", ".join(_options(folder))
            raise HookrunError(
                f"{group}=null: a config group takes one of its options; valid: {options}, or "
                f"no {group}= override (the default or the experiment's choice)"
            )
