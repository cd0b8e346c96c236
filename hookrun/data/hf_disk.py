"""`dataset=hf_disk`: a Hugging Face `datasets` folder written by `save_to_disk`, read
offline (memory-mapped Arrow files; nothing is downloaded, nothing written beside it), as
the token rows of `dataset=text` (`rows: text`: the string column `field` is the corpus,
packed or one row per document) or of `dataset=prompts` (`rows: prompts`: the columns
prompt, answer, counterfactual, counterfactual_answer). The same keys as those kinds, and
the same tokenizing (a corpus streamed, hookrun/data/text.py), so a corpus gives the same
rows from a .jsonl as from its save_to_disk folder (tested).

A row's source is the split's folder and the row's index in it (0-based, as `ds[i]` reads
it): /samples/path and /samples/line, and every refusal names them as `FOLDER:INDEX`.
`datasets` comes with the hf extra and is imported only here, on use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hookrun.data.kinds import DATASETS, DatasetKind
from hookrun.data.prompts import PROMPT_COLUMNS, PromptsDatasetConfig, prompt_rows, prompt_texts
from hookrun.data.text import CorpusRows, TextDatasetConfig, field_documents, text_rows
from hookrun.data.tokens import Tokenizing, TokenRows
from hookrun.errors import HookrunError
from hookrun.extras import missing_extra
from hookrun.typed import Frozen

__all__ = ["HfDiskDatasetConfig", "build_hf_disk"]

_ROWS = ("text", "prompts")
_FOLDER = "a folder written by datasets' save_to_disk"
_STRINGS = ("string", "large_string")
_BATCH = 1024  # rows read from the Arrow files at a time


@dataclass
class HfDiskDatasetConfig(Frozen):
    kind: str = "hf_disk"
    path: str | None = None
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    split: str | None = None
    """The split of a DatasetDict folder; null: its only split (several are refused)."""
    rows: str = "text"
    """text: a corpus, read like dataset=text; prompts: rows read like dataset=prompts."""
    field: str = "text"
    """The keys of dataset=text (rows: text) and dataset=prompts (context, prepend_bos)."""
    context: int = 128
    """Tokens per row (rows: text), as dataset.context of dataset=text."""
    pack: bool = True
    """rows: text: join the documents into full rows of `context` tokens (true) or one row per
    document (false), as dataset=text.
    """
    prepend_bos: bool = False
    """Put the tokenizer's bos token before each row."""
    read: Any = "last"
    """The row's read position: last, or a position i (negative: from the end), as dataset=text."""

    def check(self) -> None:
        if self.rows not in _ROWS:
            raise HookrunError(f"dataset.rows: {self.rows!r}; valid: {', '.join(_ROWS)}")
        if self.rows == "prompts":  # the corpus's keys would be silently ignored
            for key, default in (("field", "text"), ("pack", True), ("read", "last")):
                value = getattr(self, key)
                if value != default or isinstance(value, bool) != isinstance(default, bool):
                    raise HookrunError(
                        f"dataset.{key}: {_yaml(value)} applies to rows: text; valid with "
                        f"rows: prompts: {_yaml(default)} (the default), or dataset.rows=text"
                    )
        self.as_kind().check()

    def as_kind(self) -> TextDatasetConfig | PromptsDatasetConfig:
        """The text or prompts config whose rows these are (its path: the folder)."""
        if self.rows == "prompts":
            return PromptsDatasetConfig(
                path=self.path, context=self.context, prepend_bos=self.prepend_bos
            )
        return TextDatasetConfig(
            path=self.path,
            field=self.field,
            context=self.context,
            pack=self.pack,
            prepend_bos=self.prepend_bos,
            read=self.read,
        )


def _yaml(value: Any) -> str:
    """A config value as YAML writes it (true, null), not as Python does (True, None)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def build_hf_disk(
    cfg: HfDiskDatasetConfig, seed: int, tokenizing: Tokenizing
) -> TokenRows | CorpusRows:
    """The split's rows: prompts every one read and refused before anything is tokenized,
    a corpus (rows: text) refused or tokenized a batch at a time, before the first batch."""
    tokenizer = tokenizing.tokenizer
    split, where = _split(cfg)
    if cfg.rows == "prompts":
        present = [c for c in PROMPT_COLUMNS if c in split.column_names]
        if PROMPT_COLUMNS[0] not in present:
            raise HookrunError(
                f"dataset.path: {where} has no 'prompt' column (it has: "
                f"{', '.join(split.column_names) or 'none'}); valid: string columns prompt, "
                "answer?, counterfactual?, counterfactual_answer?"
            )
        records = _records(split, where, present, "dataset.path")
        return prompt_rows(prompt_texts(records, where), cfg.as_kind(), tokenizer)
    if cfg.field not in split.column_names:
        raise HookrunError(
            f"dataset.field: {cfg.field!r} is not a column of {where}; valid: one of its "
            f"string columns: {', '.join(_string_columns(split)) or 'none'}"
        )
    docs = field_documents(_records(split, where, [cfg.field], "dataset.field"), cfg.field)
    # No token cache: the split's identity would be its arrow files; `limit` is kept.
    limited = Tokenizing(tokenizer, tokenizing.limit)
    return text_rows(docs, cfg.as_kind(), limited)  # type: ignore[arg-type]


def _split(cfg: HfDiskDatasetConfig) -> tuple[Any, str]:
    """The Dataset to read and its folder (absolute): the folder itself, or its split's."""
    try:
        import datasets  # an optional extra: pip install hookrun[hf]
    except ImportError:
        raise missing_extra(
            "dataset.kind: 'hf_disk'", "hf", "dataset=text with the rows exported to .jsonl"
        ) from None
    if cfg.path is None:
        raise HookrunError(f"dataset.path: null; valid: {_FOLDER} (give dataset.path=...)")
    # Absolute and local: fsspec would read a URL such as s3://… from the network.
    where = os.path.abspath(os.path.expanduser(str(cfg.path)))
    if not os.path.isdir(where):
        raise HookrunError(f"dataset.path: {cfg.path!r} is not a folder; valid: {_FOLDER}")
    try:
        loaded = datasets.load_from_disk(where)
    except Exception as err:  # a partial or foreign folder: any of the library's errors
        raise HookrunError(
            f"dataset.path: {where} cannot be read as a datasets folder ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}); valid: {_FOLDER}"
        ) from None
    if not isinstance(loaded, datasets.DatasetDict):
        if cfg.split is not None:
            raise HookrunError(
                f"dataset.split: {cfg.split!r}, but {where} holds one dataset, not splits; "
                "valid: null"
            )
        return _validated(loaded, where), where
    names = sorted(loaded)
    name = cfg.split
    if name is None and len(names) == 1:
        name = names[0]
    if name not in loaded:
        said = "null" if cfg.split is None else repr(cfg.split)
        raise HookrunError(
            f"dataset.split: {said}, but {where} holds the splits {', '.join(names) or 'none'}; "
            f"valid: {', '.join(names) or 'a folder with a split'}"
        )
    return _validated(loaded[name], os.path.join(where, name)), os.path.join(where, name)


def _validated(split: Any, where: str) -> Any:
    """The split, once its Arrow data passed pyarrow's full check: damaged offsets would
    otherwise read past their buffers (a crash, or wrong text without a word)."""
    try:
        split.data.table.validate(full=True)
    except Exception as err:  # pyarrow's ArrowInvalid, or anything a damaged file raises
        raise HookrunError(
            f"dataset.path: {where} holds damaged Arrow data ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:160]}); valid: {_FOLDER}"
        ) from None
    return split


def _string_columns(split: Any) -> list[str]:
    return [
        name
        for name, feature in split.features.items()
        if getattr(feature, "dtype", None) in _STRINGS
    ]


def _records(split: Any, where: str, columns: list[str], key: str) -> Iterator[tuple]:
    """(folder, row index, {column: value}) for every row, as json_rows gives a file's; a
    column that does not hold strings is refused before any row is read."""
    strings = _string_columns(split)
    for column in columns:
        if column not in strings:
            feature = split.features[column]
            raise HookrunError(
                f"{key}: the column {column!r} of {where} holds {feature}, not strings; "
                f"valid: a string column: {', '.join(strings) or 'none'}"
            )
    index, batches = 0, split.select_columns(columns).iter(batch_size=_BATCH)
    while True:  # a batch in memory at a time
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:  # damaged Arrow data: any of pyarrow's or a decode error
            raise HookrunError(
                f"dataset.path: {where}: the rows from {index} cannot be read "
                f"({type(err).__name__}: {' '.join(str(err).split())[:160]}); valid: {_FOLDER}"
            ) from None
        for values in zip(*(batch[column] for column in columns), strict=True):
            yield where, index, dict(zip(columns, values, strict=True))
            index += 1


DATASETS.register("hf_disk")(DatasetKind(HfDiskDatasetConfig, build_hf_disk, tokens=True))
