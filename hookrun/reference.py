"""Every config key a user can set, read from the code that parses it.

The schema's dataclasses are the one source: each field's type and default, its valid
choices (an Enum's members, or the `choices` of the field's metadata, which the check of
that key reads too) and its meaning (the field's attribute docstring: the string literal
under it). The free-form nodes are read from what parses them: the model (`ModelConfig`),
each dataset kind's schema (`DATASETS`), each hook action's `Args` (`ACTIONS`) and each
stage's `Stage.schema()`. docs/gen_reference.py writes the site's configuration reference
from `config_keys()`, and tests/docs/test_reference.py checks every key of every composed
experiment against it.

A top-level module: it reads the config, the registries and the stages, and nothing in
hookrun reads it.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import hookrun.stages  # noqa: F401  (registers every stage, and with them their nodes)
from hookrun.config.schema import RunConfig
from hookrun.data.kinds import DATASETS
from hookrun.models.config import ModelConfig
from hookrun.runtime.actions import ACTIONS, CommonArgs
from hookrun.runtime.hookspec import HookConfig
from hookrun.stage import stages

__all__ = ["Key", "attribute_docs", "dataclass_keys", "config_keys", "HOOK", "FREE_FORM"]

# How the reference writes a hook's own name, chosen by the user (`hooks.grad.at`).
HOOK = "hooks.<name>"
# Top-level keys whose contents are read by their own schema below, not RunConfig's `Any`.
FREE_FORM = ("model", "dataset", "hooks")


@dataclass(frozen=True)
class Key:
    """One config key as the reference lists it.

    Attributes:
        key: The key in full, as a user types it (`sink.dtype`, `hooks.<name>.args.alpha`).
        type: Its Python type, as the schema declares it.
        default: Its default, as YAML would write it (`required` where there is none).
        choices: Its valid values, where the code checks it against a fixed set.
        meaning: What it does (the field's docstring); empty where the code says nothing.
        when: The setting under which the key exists (`dataset.kind=text`), or empty.
    """

    key: str
    type: str
    default: str
    choices: tuple[str, ...]
    meaning: str
    when: str = ""


@cache
def _class_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a class made at run time (make_dataclass) has no source
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field, after in zip(body, body[1:], strict=False):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def attribute_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a class and its bases: field name → text.

    Args:
        cls: A class whose fields may each be followed by a string literal.

    Returns:
        The docstring of every field that has one, a subclass's over its base's.
    """
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        docs.update(_class_docs(base))
    return docs


def _type_name(hint: Any) -> str:
    if hint is Any:
        return "any"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return "required" if field.default == "???" else _yaml(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _yaml(field.default_factory())
    return "required"


def _choices(field: dataclasses.Field, hint: Any) -> tuple[str, ...]:
    if "choices" in field.metadata:
        return tuple(_yaml(c) for c in field.metadata["choices"])
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    enums = [o for o in options if isinstance(o, type) and issubclass(o, enum.Enum)]
    if enums:
        nullable = type(None) in typing.get_args(hint)
        return tuple(m.value for m in enums[0]) + (("null",) if nullable else ())
    if hint is bool:
        return ("true", "false")
    return ()


def _config_name(field: str) -> str:
    """A field's key in the config: `class_` stands for `class`, a Python keyword."""
    return field[:-1] if field.endswith("_") and not field.startswith("_") else field


def dataclass_keys(schema: type, prefix: str, when: str = "") -> Iterator[Key]:
    """The keys of a config dataclass, nested dataclasses written out key by key.

    Args:
        schema: The dataclass a node of the config is merged into.
        prefix: The node's key (`sink`, `hooks.<name>.args`), or "" for the top level.
        when: The setting under which the node's keys exist, or "".

    Yields:
        One Key per field, in the schema's order.
    """
    hints = typing.get_type_hints(schema)
    docs = attribute_docs(schema)
    for field in dataclasses.fields(schema):
        key = f"{prefix}.{_config_name(field.name)}" if prefix else _config_name(field.name)
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from dataclass_keys(hint, key, when)  # type: ignore[arg-type]
            continue
        meaning = docs.get(field.name, "")
        yield Key(key, _type_name(hint), _default(field), _choices(field, hint), meaning, when)


def _run_keys() -> Iterator[Key]:
    for key in dataclass_keys(RunConfig, ""):
        if key.key.split(".")[0] not in FREE_FORM:
            yield key


def _hook_keys() -> Iterator[Key]:
    for key in dataclass_keys(HookConfig, HOOK):
        if key.key == f"{HOOK}.action":
            yield dataclasses.replace(key, choices=tuple(ACTIONS.choices()))
        elif key.key != f"{HOOK}.args":  # its keys are each action's, below
            yield key
    yield from dataclass_keys(CommonArgs, f"{HOOK}.args")
    for name, action in ACTIONS.items():
        yield from dataclass_keys(action.Args, f"{HOOK}.args", f"{HOOK}.action={name}")


def _dataset_keys() -> Iterator[Key]:
    for name, kind in DATASETS.items():
        for key in dataclass_keys(kind.schema, "dataset", f"dataset.kind={name}"):
            if key.key == "dataset.kind":
                meaning = "The dataset kind; `dataset=NAME` picks a preset of one."
                choices = tuple(DATASETS.choices())
                yield dataclasses.replace(key, choices=choices, meaning=meaning, when="")
            else:
                yield key


def _stage_keys() -> Iterator[Key]:
    for stage in stages():
        for prefix, schema in stage.schema().items():
            yield from dataclass_keys(schema, prefix, "")


def config_keys() -> list[Key]:
    """Every key a user can set, grouped by node, each once per setting it exists under.

    Returns:
        The top-level keys (RunConfig's), then the model's, the dataset kinds', the hooks'
        (each action's args) and every stage's node; `dataset.kind` once.
    """
    keys: list[Key] = []
    seen: set[tuple[str, str]] = set()
    parts = (_run_keys(), dataclass_keys(ModelConfig, "model"), _dataset_keys())
    for key in (*[k for part in parts for k in part], *_hook_keys(), *_stage_keys()):
        if (key.key, key.when) not in seen:
            seen.add((key.key, key.when))
            keys.append(key)
    return keys
