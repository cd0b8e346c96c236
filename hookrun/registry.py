"""Registries: the extension points of hookrun, one table each.

Dataset kinds (`hookrun/data/kinds.py`), hook actions (`hookrun/runtime/actions.py`),
derived methods (`hookrun.stages.derive.registry.py`) and model sources
(`hookrun/models/sources.py`) are each one `@REGISTRY.register(name)` in one file. Error
messages and the docs list `choices()`, so the valid choices a user reads cannot drift from
what the code accepts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from hookrun.errors import HookrunError, did_you_mean

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Name → entry for one extension point; `what` names one entry in messages ("an action")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: add the decorated class or function under `name`."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def register_class(self, name: str) -> Callable[[type], type]:
        """Class decorator: register an instance of the class under `name`, which the class
        keeps as its `name` (derived methods, metrics)."""

        def add(cls: type) -> type:
            cls.name = name  # type: ignore[attr-defined]
            self.register(name)(cls())
            return cls

        return add

    def get(self, name: object, key: str) -> T:
        """The entry called `name`; HookrunError naming `key`, the value and the choices."""
        if not isinstance(name, str) or name not in self._entries:
            did = did_you_mean(name, self._entries)
            raise HookrunError(
                f"{key}: {name!r} is not {self.what}; valid: {', '.join(self.choices())}{did}"
            )
        return self._entries[name]

    def choices(self) -> list[str]:
        """Every registered name, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())
