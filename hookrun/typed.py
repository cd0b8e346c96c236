"""Typed config nodes: free-form YAML merged into dataclasses, with one-line errors.

Bottom of the house: the spec, the registries' entries (dataset kinds, actions, derived
methods) and the model sources all parse their part of the config through here.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hookrun.errors import HookrunError, did_you_mean, unknown_key

__all__ = ["Frozen", "freeze", "parse_typed", "check_range", "check_finite", "import_class"]


class Frozen:
    """Base of the config dataclasses: writable while OmegaConf builds them, read-only once
    `freeze()` has run on the finished RunSpec (nothing downstream can change the run)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)


def freeze(value: Any) -> Any:
    """`value` made read-only all the way down: Frozen dataclasses locked, dicts turned into
    read-only mappings and lists into tuples."""
    if isinstance(value, Frozen):
        for f in dataclasses.fields(value):  # type: ignore[arg-type]
            object.__setattr__(value, f.name, freeze(getattr(value, f.name)))
        object.__setattr__(value, "_frozen", True)
        return value
    if isinstance(value, dict):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    return value


def _keys_of(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def parse_typed(node: Any, schema: type, key: str) -> Any:
    """Merge a free-form config node into `schema`; errors name `key.<field>`."""
    if node is None:
        node = {}
    if isinstance(node, MappingProxyType):
        node = dict(node)
    if not isinstance(node, (dict, DictConfig)):
        raise HookrunError(f"{key}: expected a mapping with keys {_keys_of(schema)}, got {node!r}")
    raw = OmegaConf.create(node) if isinstance(node, dict) else node
    valid = _keys_of(schema)
    for name in raw:
        if name not in valid:
            raise unknown_key(key, name, valid)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        sub = getattr(err, "full_key", None) or getattr(err, "key", None)
        where = f"{key}.{sub}" if sub else key
        msg = str(getattr(err, "msg", err)).splitlines()[0]
        raise HookrunError(f"{where}: {msg}") from None


def check_choices(key: str, values: Sequence[str], valid: Sequence[str], what: str) -> None:
    """A non-empty list of `valid` names, none twice (`what` names one in the message), else
    HookrunError naming `key` or `key[i]`."""
    if not values:
        raise HookrunError(f"{key}: []; valid: any of {', '.join(valid)}")
    for i, name in enumerate(values):
        if name not in valid:
            did = did_you_mean(name, valid)
            raise HookrunError(f"{key}[{i}]: {name!r}{did}; valid: {', '.join(valid)}")
    if len(set(values)) != len(values):
        raise HookrunError(f"{key}: {list(values)} names {what} twice; valid: each once")


def check_range(key: str, value: int | None, low: int, allow_none: bool = False) -> None:
    """An integer >= `low` (or None when allowed), else HookrunError naming `key`."""
    if value is None and allow_none:
        return
    if value is None or value < low:
        raise HookrunError(f"{key}: {value!r} is out of range; valid: an integer >= {low}")


def check_finite(key: str, parsed: Any) -> None:
    """Every float field of the dataclass `parsed` is a finite number."""
    for f in dataclasses.fields(parsed):
        value = getattr(parsed, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise HookrunError(
                f"{key}.{f.name}: {value} is not a finite number; valid: a finite number"
            )


def import_class(dotted: str, key: str, base: type) -> type:
    """The class at `dotted` (`package.module.Class`), which must subclass `base`."""
    module_name, _, attr = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as err:
        raise HookrunError(f"{key}: cannot import {dotted!r} ({err})") from None
    if cls is None:
        raise HookrunError(f"{key}: {dotted!r} is not a dotted path such as package.module.Class")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise HookrunError(
            f"{key}: {dotted!r} is not a subclass of {base.__module__}.{base.__name__}"
        )
    return cls
