"""`dataset=prompts`: a .jsonl of {prompt, answer?, counterfactual?, counterfactual_answer?}
as token rows (hookrun/data/tokens.py says the sample), all as long as the file's longest
prompt, right-padded; each row read at its prompt's last token and labelled with the first
token of its answer (NO_LABEL when the file has no answers). The counterfactuals (for
patching and logit differences) are attributes of the dataset, not part of the sample:
`counterfactual_ids` (per row: token ids, or None) and `counterfactual_answer` (per row: the
first token, or None).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hookrun.data.corpus import data_files, json_rows, string_field
from hookrun.data.kinds import DATASETS, DatasetKind
from hookrun.data.tokens import (
    Source,
    Tokenizing,
    TokenRows,
    check_context,
    encode,
    pad_id,
    special_id,
)
from hookrun.errors import HookrunError
from hookrun.typed import Frozen

__all__ = [
    "TooLong",
    "PROMPT_COLUMNS",
    "PromptsDatasetConfig",
    "Row",
    "build_prompts",
    "prompt_rows",
    "prompt_texts",
]

PROMPT_COLUMNS = ("prompt", "answer", "counterfactual", "counterfactual_answer")
_PROMPT_ROW = "rows {prompt, answer?, counterfactual?, counterfactual_answer?} of strings"
Row = tuple[Source, list[str | None]]  # a row's source and its texts, in PROMPT_COLUMNS order


class TooLong(HookrunError):
    """A row longer than `dataset.context`; `where` (e.g. "prompt at file.jsonl:3") and
    `length` let a caller that set the context for another reason say so its own way."""

    def __init__(self, where: str, length: int, context: int) -> None:
        super().__init__(
            f"dataset.context: {context} is shorter than the {where} ({length} tokens); "
            f"valid: a context of {length} or more"
        )
        self.where, self.length = where, length


@dataclass
class PromptsDatasetConfig(Frozen):
    kind: str = "prompts"
    path: str | None = None
    """A .jsonl file of {prompt, answer?, counterfactual?, counterfactual_answer?}."""
    context: int = 128
    """The longest prompt allowed; rows are as long as the file's longest prompt."""
    prepend_bos: bool = False
    """Put the tokenizer's bos token before each prompt."""

    def check(self) -> None:
        check_context(self.context)


def build_prompts(cfg: PromptsDatasetConfig, seed: int, tokenizing: Tokenizing) -> TokenRows:
    """`dataset=prompts`, every row read and refused before anything is tokenized."""
    tokenizer = tokenizing.tokenizer
    file = data_files(cfg.path, (".jsonl",), False)[0]
    return prompt_rows(prompt_texts(json_rows(file), file), cfg, tokenizer)


def prompt_rows(rows: list[Row], cfg: PromptsDatasetConfig, tokenizer: Any) -> TokenRows:
    """Prompts (prompt_texts) as token rows. The answers are tokenized alone, as written
    (" Paris" keeps its space: no space is added)."""
    bos = special_id(tokenizer, ("bos", "cls"), "dataset.prepend_bos") if cfg.prepend_bos else None
    lead = [] if bos is None else [bos]
    prompts: list[list[int]] = _column(tokenizer, rows, 0, (lead, cfg.context))  # type: ignore[assignment]
    lengths = np.array([len(ids) for ids in prompts], np.int64)
    ids = np.full((len(rows), int(lengths.max())), pad_id(tokenizer), np.int64)
    for r, prompt in enumerate(prompts):
        ids[r, : len(prompt)] = prompt
    answers = _firsts(_column(tokenizer, rows, 1, ([], None)))
    labels = None if answers[0] is None else np.array(answers, np.int64)
    data = TokenRows(ids, lengths, lengths - 1, labels, [where for where, _ in rows])
    data.counterfactual_ids = _column(tokenizer, rows, 2, (lead, cfg.context))
    data.counterfactual_answer = _firsts(_column(tokenizer, rows, 3, ([], None)))
    return data


def prompt_texts(records: Iterable[tuple[str, int, dict[str, Any]]], where: Any) -> list[Row]:
    """Every (source, number, row)'s source and texts; refused: no prompt, a non-string
    value, no rows at all (`where` is named), and answers on some rows but not others."""
    rows: list[Row] = []
    for name, number, row in records:
        texts = [string_field(row, key, (name, number), "dataset.path") for key in PROMPT_COLUMNS]
        if texts[0] is None:
            raise HookrunError(
                f"dataset.path: {name}:{number} has no 'prompt'; valid: {_PROMPT_ROW}"
            )
        if rows and (texts[1] is None) != (rows[0][1][1] is None):
            has, lacks = ((name, number), rows[0][0])
            if texts[1] is None:
                has, lacks = lacks, has
            raise HookrunError(
                f"dataset.path: {lacks[0]}:{lacks[1]} has no 'answer' but {has[0]}:{has[1]} "
                "has one; valid: an answer on every row or on none"
            )
        rows.append(((name, number), texts))
    if not rows:
        raise HookrunError(f"dataset.path: {where} is empty (no prompts); valid: {_PROMPT_ROW}")
    return rows


def _column(tokenizer: Any, rows: list[Row], column: int, limits: tuple) -> list[list[int] | None]:
    """Column `column` of every row tokenized, behind `lead` (a bos); None where the row has
    none. Refused: no tokens, or more than `context` (None: any length)."""
    lead, context = limits
    what = PROMPT_COLUMNS[column]
    present = [texts[column] for _, texts in rows if texts[column] is not None]
    encoded = iter(encode(tokenizer, present))  # type: ignore[arg-type]
    out: list[list[int] | None] = []
    for (name, number), texts in rows:
        if texts[column] is None:
            out.append(None)
            continue
        ids = [*lead, *(int(t) for t in next(encoded))]
        if not ids:
            raise HookrunError(
                f"dataset.path: {name}:{number}: the {what} has no tokens; valid: a {what} "
                "of one token or more"
            )
        if context is not None and len(ids) > context:
            raise TooLong(f"{what} at {name}:{number}", len(ids), context)
        out.append(ids)
    return out


def _firsts(column: list[list[int] | None]) -> list[int | None]:
    return [None if ids is None else ids[0] for ids in column]


DATASETS.register("prompts")(DatasetKind(PromptsDatasetConfig, build_prompts, tokens=True))
