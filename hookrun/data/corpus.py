"""Reading token data's source files line by line, so that every refusal names the file and
the 1-based line: a path that does not exist, an empty file, a folder without data files, a
byte that is not UTF-8, a line that is not a JSON object, a missing or non-string field.

Lines are split at b"\\n" only (as editors and `wc -l` count them; str.splitlines would also
split at form feeds and Unicode separators), a trailing "\\r" and a leading byte-order mark
dropped. Blank lines are skipped; they still count for the line numbers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hookrun.errors import HookrunError

__all__ = ["Line", "data_files", "lines", "json_rows", "string_field"]

# One line of a source file: (absolute path, 1-based line number, text).
Line = tuple[str, int, str]


def data_files(path: str | None, suffixes: tuple[str, ...], folders: bool) -> list[Path]:
    """The files `dataset.path` names: the file itself, or (with `folders`) the files of a
    folder with one of `suffixes`, sorted by name; absolute, `~` expanded."""
    valid = " or ".join(suffixes) + (" file, or a folder of them" if folders else " file")
    if path is None:
        raise HookrunError(f"dataset.path: null; valid: a {valid} (give dataset.path=...)")
    where = Path(os.path.abspath(os.path.expanduser(str(path))))
    if where.is_dir() and folders:
        files = sorted(f for f in where.iterdir() if f.suffix in suffixes and f.is_file())
        if not files:
            raise HookrunError(
                f"dataset.path: {where} has no {' or '.join(suffixes)} file; valid: a {valid}"
            )
        return files
    if not where.exists():
        raise HookrunError(f"dataset.path: {path!r} does not exist; valid: a {valid}")
    if not where.is_file() or where.suffix not in suffixes:
        raise HookrunError(f"dataset.path: {where}; valid: a {valid}")
    return [where]


def lines(file: Path) -> Iterator[Line]:
    """The non-blank lines of `file`, decoded one by one (a bad byte names its line)."""
    name = str(file)
    try:
        with open(file, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise HookrunError(
                        f"dataset.path: {name}:{number}: byte 0x{raw[err.start]:02x} at column "
                        f"{err.start + 1} is not UTF-8; valid: UTF-8 text"
                    ) from None
                if number == 1:
                    text = text.removeprefix("\ufeff")
                text = text.removesuffix("\n").removesuffix("\r")
                if text.strip():
                    yield name, number, text
    except OSError as err:
        raise HookrunError(f"dataset.path: cannot read {name} ({err.strerror or err})") from None


def json_rows(file: Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(path, line, object) for every non-blank line of a .jsonl file."""
    for name, number, text in lines(file):
        try:
            row = json.loads(text)
        except json.JSONDecodeError as err:
            raise HookrunError(
                f"dataset.path: {name}:{number} is not JSON ({err.msg} at column {err.colno}); "
                "valid: one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise HookrunError(
                f"dataset.path: {name}:{number} is a JSON {type(row).__name__}, not an object; "
                "valid: one JSON object per line"
            )
        yield name, number, row


def string_field(row: dict[str, Any], name: str, where: tuple[str, int], key: str) -> str | None:
    """`row[name]` when it is a string, None when it is absent or null; refused naming `key`
    and the line when it is anything else."""
    value = row.get(name)
    if value is None:
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # a JSON escape such as \ud800 is a lone surrogate
        except UnicodeEncodeError as err:
            raise HookrunError(
                f"{key}: {where[0]}:{where[1]}: {name!r} holds the lone surrogate "
                f"U+{ord(value[err.start]):04X}, not UTF-8 text; valid: a string of characters"
            ) from None
        return value
    kind = type(value).__name__
    raise HookrunError(
        f"{key}: {where[0]}:{where[1]}: {name!r} is a JSON {kind} ({json.dumps(value)[:40]}); "
        "valid: a string"
    )
