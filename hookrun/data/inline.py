"""Rows a Python caller hands to `hookrun.run(dataset=...)` as plain values: a list of
strings (documents, read as dataset=text reads a .jsonl's `text` field) or of prompt dicts
(`prompt`, and `answer`, `counterfactual`, `counterfactual_answer` where used, read as
dataset=prompts reads a .jsonl). They are written to `<run dir>/dataset.jsonl` and read from
there by the kind itself, so the run's file is the file of the same rows given as a .jsonl,
and the run directory keeps the data it was made from."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hookrun.errors import HookrunError

__all__ = ["inline_rows", "write_rows", "INLINE_FILE"]

INLINE_FILE = "dataset.jsonl"
_PROMPT_KEYS = ("prompt", "answer", "counterfactual", "counterfactual_answer")


def inline_rows(dataset: Any) -> tuple[str, list[dict]] | None:
    """The dataset kind and .jsonl rows of a list of strings or prompt dicts; None for any
    other dataset (a torch Dataset, tensors: hookrun's caller datasets)."""
    if isinstance(dataset, (str, bytes)) or not isinstance(dataset, Sequence) or not dataset:
        return None
    if all(isinstance(row, str) for row in dataset):
        return "text", [{"text": row} for row in dataset]
    if not all(isinstance(row, Mapping) for row in dataset):
        if any(isinstance(row, (str, Mapping)) for row in dataset):
            raise HookrunError(
                "dataset: a list mixing strings, dicts and other items; valid: a list of "
                "strings (documents) or of prompt dicts, or a torch Dataset"
            )
        return None
    rows = []
    for i, row in enumerate(dataset):
        unknown = [k for k in row if k not in _PROMPT_KEYS]
        if unknown or "prompt" not in row:
            what = f"the key {unknown[0]!r}" if unknown else "no 'prompt'"
            raise HookrunError(f"dataset[{i}]: has {what}; valid keys: {', '.join(_PROMPT_KEYS)}")
        bad = [k for k, v in row.items() if not isinstance(v, str)]
        if bad:
            raise HookrunError(f"dataset[{i}].{bad[0]}: {row[bad[0]]!r}; valid: a string")
        rows.append({k: row[k] for k in _PROMPT_KEYS if k in row})
    return "prompts", rows


def write_rows(rows: list[dict], path: Path) -> None:
    """`rows` as a .jsonl at `path`; a file already there (a resumed run's) must hold the same
    rows: nothing already written is replaced."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if path.exists():
        if path.read_text(encoding="utf-8") != text:
            raise HookrunError(
                f"dataset: {path} holds other rows than the ones given (an earlier run's); "
                "valid: another run_dir, or the same rows"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".jsonl.part")
    part.write_text(text, encoding="utf-8")
    part.replace(path)
