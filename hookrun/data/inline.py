"""Rows a Python caller hands to `hookrun.run(dataset=...)` as plain values: a list of
strings (documents, read as dataset=text reads a .jsonl's `text` field) or of prompt dicts
(`prompt`, and `answer`, `counterfactual`, `counterfactual_answer` where used, read as
dataset=prompts reads a .jsonl). They are written to `<run dir>/dataset.jsonl` and read from
there by the kind itself, so the run's file is the file of the same rows given as a .jsonl,
and the run directory keeps the data it was made from.

Token ids already made — a tokenizer's output, `{input_ids, attention_mask}` (N, T), padded
on either side — become token rows in memory (token_tensors), as dataset=prompts lays out
the same prompts: each row's real tokens first, right-padded, read at its last one."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookrun.data.tokens import Numbered, TokenRows
from hookrun.errors import HookrunError

__all__ = ["inline_rows", "write_rows", "token_tensors", "INLINE_FILE"]

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


_TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def token_tensors(dataset: Any) -> TokenRows | None:
    """Token rows of `{input_ids, attention_mask}` (a tokenizer's output: tensors, arrays or
    lists, (N, T)); None for any other dataset."""
    if not isinstance(dataset, Mapping) or "input_ids" not in dataset:
        return None
    unknown = [k for k in dataset if k not in _TOKEN_KEYS]
    if unknown:
        raise HookrunError(
            f"dataset.{unknown[0]}: not a key of token rows; valid: {', '.join(_TOKEN_KEYS)}"
        )
    ids = _integers(dataset["input_ids"], "input_ids")
    if (ids < 0).any():
        row, column = (int(i[0]) for i in np.nonzero(ids < 0))
        raise HookrunError(
            f"dataset.input_ids: {int(ids[row, column])} at row {row}, token {column}; valid: "
            "token ids of the model's vocabulary (0 or more)"
        )
    given = dataset.get("attention_mask")
    mask = np.ones_like(ids) if given is None else _integers(given, "attention_mask")
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise HookrunError(
            f"dataset.attention_mask: shape {list(mask.shape)} of values "
            f"{sorted(set(np.unique(mask).tolist()))[:4]}; valid: 0s and 1s of input_ids' "
            f"shape {list(ids.shape)}"
        )
    types = dataset.get("token_type_ids")
    if types is not None and _integers(types, "token_type_ids").any():
        raise HookrunError(
            "dataset.token_type_ids: not all 0; valid: one segment per row (or leave it out)"
        )
    lengths = mask.sum(1)
    # Each row's real tokens must be one run (left or right padding), and at least one.
    starts = mask.argmax(1)
    ends = starts + lengths
    columns = np.arange(ids.shape[1])[None]
    held = (columns >= starts[:, None]) & (columns < ends[:, None])
    bad = np.flatnonzero((lengths == 0) | (held != mask.astype(bool)).any(1))
    if len(bad):
        raise HookrunError(
            f"dataset.attention_mask: row {int(bad[0])} is not one run of real tokens; valid: "
            "each row's 1s together (padding on the left or on the right), at least one"
        )
    pads = ids[mask == 0]
    pad = int(pads[0]) if len(pads) else 0
    right = np.full(ids.shape, pad, dtype=np.int64)
    for r in range(len(ids)):
        right[r, : lengths[r]] = ids[r, starts[r] : ends[r]]
    rows = TokenRows(right, lengths, lengths - 1, None, Numbered("input_ids", len(ids)))
    rows.from_files = False  # /samples/path says `input_ids`, from any folder
    return rows


def _integers(value: Any, key: str) -> np.ndarray:
    try:
        array = value.cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    except ValueError:  # rows of different lengths: a tokenizer's output without padding
        raise HookrunError(
            f"dataset.{key}: rows of different lengths; valid: rows of one length, as a "
            "tokenizer returns them with padding=True"
        ) from None
    if array.dtype == np.bool_ and key == "attention_mask":
        array = array.astype(np.int64)
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer) or 0 in array.shape:
        raise HookrunError(
            f"dataset.{key}: {array.dtype} of shape {list(array.shape)}; valid: integers "
            "(rows, tokens), as a tokenizer returns them (padding=True)"
        )
    return array.astype(np.int64)
