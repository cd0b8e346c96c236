"""Classes named by dotted paths in the config (`model._target_`, `select.type`)."""

from __future__ import annotations

import importlib

from hookrun.errors import HookrunError

__all__ = ["import_class"]


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
