"""Token data for language models: `dataset=text` (a corpus) and `dataset=prompts` (prompts
with answers and counterfactuals), tokenized with the model's tokenizer.

Item i is (tensor, label, i). `tensor` is int64 (3, T), T one length for the whole dataset:
row 0 the token ids (padding holds the tokenizer's pad id, else its eos, else 0), row 1 the
attention mask (1 for a real token; padding always on the right, so real tokens keep their
positions), row 2 the read marker (1 at the one real position whose next-token logits are
the row's output). `label` is the target token (the actual next token after the read
position for text, the first token of the answer for prompts) or NO_LABEL.

The dataset (a TokenRows) says `tokens` (True), `has_labels`, `padded` (whether any row has
padding) and `sources` (per row: absolute source file and 1-based line). The kinds are built
as `build(cfg, seed, tokenizer)`; every refusal of the data happens there, before the first
batch, except a token id past the model's vocabulary: `check_vocab(data, vocab_size)`, once
the model is built.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from hookrun.data.corpus import Line, data_files, json_rows, lines, string_field
from hookrun.data.kinds import DATASETS, NO_LABEL, DatasetKind
from hookrun.errors import HookrunError
from hookrun.memory import check_fits
from hookrun.typed import Frozen, check_range

__all__ = [
    "Source",
    "TextDatasetConfig",
    "TokenRows",
    "build_text",
    "field_documents",
    "text_rows",
    "check_vocab",
    "token_rows",
    "check_context",
    "special_id",
    "pad_id",
    "encode",
]

_ID = 8  # bytes of one int64 token id
_CHUNK = 1024  # documents per call of the tokenizer
_LAST = "last"
Source = tuple[str, int]  # (absolute path, 1-based line)


def check_context(context: int) -> None:
    """`dataset.context`: two tokens or more (a read position and its next token), and a row
    that fits in memory."""
    check_range("dataset.context", context, 2)
    check_fits("dataset.context", context, 3 * _ID * context, f"one row [3, {context}]")


def _read_at(read: Any, length: int) -> int | None:
    """The read position in a row of `length` real tokens (None where the row is too short
    for it): `last` is the second-to-last token, an int i is i, from the end when negative;
    the token after it must be real too (it is the label)."""
    pos = length - 2 if read == _LAST else (read if read >= 0 else length + read)
    return pos if 0 <= pos <= length - 2 else None


def _read_valid(context: int) -> str:
    return f"last, or an integer from 0 to {context - 2} or from -{context} to -2"


@dataclass
class TextDatasetConfig(Frozen):
    kind: str = "text"
    # A .txt file (one document per line; blank lines skipped), a .jsonl file (the string
    # `field` of each row) or a folder of them (sorted by name). `~` and paths relative to
    # the working directory work. null: the experiment's default corpus, where it has one.
    path: str | None = None
    field: str = "text"
    # Tokens per row.
    context: int = 128
    # true: the documents joined by the tokenizer's eos (else sep) token and cut into full
    # rows of `context` tokens, the last partial row dropped; false: one row per document,
    # truncated or right-padded to `context` (with its attention mask).
    pack: bool = True
    # A bos token (else cls) at the start of every row.
    prepend_bos: bool = False
    # The row's read position: last (the second-to-last real token: the label, its actual
    # next token, is the last), or an int i (negative: from the end of the real tokens);
    # the label is the token at i + 1.
    read: Any = _LAST

    def check(self) -> None:
        check_context(self.context)
        if not self.field:
            raise HookrunError("dataset.field: ''; valid: the key of each .jsonl row's text")
        if isinstance(self.read, bool) or not (self.read == _LAST or isinstance(self.read, int)):
            raise HookrunError(f"dataset.read: {self.read!r}; valid: {_read_valid(self.context)}")
        if _read_at(self.read, self.context) is None:
            raise HookrunError(
                f"dataset.read: {self.read} has no next token in a row of {self.context}; "
                f"valid: {_read_valid(self.context)}"
            )


class _Packing(NamedTuple):
    """Where packed rows come from: each document's first offset in the joined stream."""

    starts: np.ndarray
    documents: list[Source]
    width: int  # stream tokens per row
    lead: int  # 1 with prepend_bos (a bos first in every row), else 0


class TokenRows(Dataset):
    """Rows of token ids, each with its number of real tokens, read position and label."""

    tokens = True

    def __init__(
        self,
        ids: np.ndarray,
        lengths: np.ndarray,
        reads: np.ndarray,
        labels: np.ndarray | None,
        sources: list[Source],
    ) -> None:
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        self.lengths = torch.from_numpy(np.asarray(lengths, dtype=np.int64))
        self.reads = torch.from_numpy(np.asarray(reads, dtype=np.int64))
        self.has_labels = labels is not None
        fill = np.full(len(sources), NO_LABEL)
        self.labels = torch.from_numpy(np.asarray(fill if labels is None else labels, np.int64))
        self.sources = sources
        self.padded = bool((self.lengths < self.ids.shape[1]).any())
        self.packing: _Packing | None = None
        # What the rows are (what a target.kind reads): text, prompts or repeated_tokens;
        # dataset=hf_disk gives text or prompts rows.
        self.kind = "text"
        # dataset=prompts: per row, the counterfactual's token ids and the first token of
        # counterfactual_answer (None where the row has none); None for other data.
        self.counterfactual_ids: list[list[int] | None] | None = None
        self.counterfactual_answer: list[int | None] | None = None

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        sample = torch.zeros((3, self.ids.shape[1]), dtype=torch.int64)
        sample[0] = self.ids[index]
        sample[1, : int(self.lengths[index])] = 1
        sample[2, int(self.reads[index])] = 1
        return sample, int(self.labels[index]), index

    def source_of(self, row: int, column: int) -> Source:
        """The file and line the token at (row, column) comes from (a separator counts as
        its document's; a packed row's bos as its first document's)."""
        if self.packing is None:
            return self.sources[row]
        starts, documents, width, lead = self.packing
        offset = row * width + max(column - lead, 0)
        return documents[int(np.searchsorted(starts, offset, side="right")) - 1]

    def missing(self, row: int, fields: tuple[str, ...]) -> str | None:
        """The first of `fields` (answer, counterfactual, counterfactual_answer) that row
        `row` lacks; None when it has them all."""
        cf, cf_answer = self.counterfactual_ids, self.counterfactual_answer
        has = {
            "answer": int(self.labels[row]) != NO_LABEL,
            "counterfactual": cf is not None and cf[row] is not None,
            "counterfactual_answer": cf_answer is not None and cf_answer[row] is not None,
        }
        return next((name for name in fields if not has[name]), None)

    def counterfactual_answers(self) -> torch.Tensor:
        """Each row's counterfactual answer token (N,) int64, NO_LABEL where it has none."""
        given = self.counterfactual_answer or [None] * len(self)
        return torch.tensor([NO_LABEL if t is None else t for t in given], dtype=torch.int64)

    def fingerprint(self) -> str:
        """sha256 over every row's tokens, mask length, read position, label and source, and
        (prompts that have them: what patching and target.kind=logit_diff read) its
        counterfactual and counterfactual answer."""
        digest = hashlib.sha256()
        for part in (self.ids, self.lengths, self.reads, self.labels):
            digest.update(part.numpy().tobytes())
        digest.update(repr(self.sources).encode())
        others = (self.counterfactual_ids or [], self.counterfactual_answer or [])
        if any(x is not None for column in others for x in column):  # else as before
            digest.update(repr(others).encode())
        return digest.hexdigest()


def token_rows(data: Dataset) -> TokenRows | None:
    """The TokenRows under `data` (through the Subsets that `limit` makes), else None."""
    while isinstance(data, Subset):
        data = data.dataset
    return data if isinstance(data, TokenRows) else None


def special_id(tokenizer: Any, names: tuple[str, ...], key: str) -> int:
    """The id of the first of the tokenizer's special tokens `names` it has; `key`: true is
    refused when it has none."""
    for name in names:
        token = getattr(tokenizer, f"{name}_token_id", None)
        if token is not None:
            return int(token)
    raise HookrunError(
        f"{key}: true, but the tokenizer has no {' or '.join(names)} token; valid: false"
    )


def pad_id(tokenizer: Any) -> int:
    """What padding holds: the pad token, else eos, else 0 (the mask says it is padding)."""
    for name in ("pad", "eos"):
        token = getattr(tokenizer, f"{name}_token_id", None)
        if token is not None:
            return int(token)
    return 0


def encode(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    """Each text's token ids, without special tokens, tokenized in batches."""
    out: list[np.ndarray] = []
    for start in range(0, len(texts), _CHUNK):
        batch = texts[start : start + _CHUNK]
        ids = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        out += [np.asarray(row, dtype=np.int64) for row in ids]
    return out


def _documents(file: Path, field: str) -> list[Line]:
    """The documents of one file: its lines (.txt) or each row's `field` (.jsonl)."""
    found = list(lines(file)) if file.suffix == ".txt" else field_documents(json_rows(file), field)
    if not found:
        raise HookrunError(
            f"dataset.path: {file} is empty (no documents); valid: a file with a document"
        )
    return found


def field_documents(rows: Iterable[tuple[str, int, dict[str, Any]]], field: str) -> list[Line]:
    """The string `field` of each (source, number, row) as a document, blank ones skipped;
    a row without it (absent or null) is refused, naming its source and number."""
    found = []
    for name, number, row in rows:
        text = string_field(row, field, (name, number), "dataset.field")
        if text is None:
            raise HookrunError(
                f"dataset.field: {field!r} is missing from {name}:{number}; valid: a key "
                f"of every row (this one has: {', '.join(map(str, row)) or 'none'})"
            )
        if text.strip():
            found.append((name, number, text))
    return found


def build_text(cfg: TextDatasetConfig, seed: int, tokenizer: Any) -> TokenRows:
    """`dataset=text`: every file read and refused before anything is tokenized."""
    docs = [
        doc
        for file in data_files(cfg.path, (".txt", ".jsonl"), True)
        for doc in _documents(file, cfg.field)
    ]
    return text_rows(docs, cfg, tokenizer)


def text_rows(docs: list[Line], cfg: TextDatasetConfig, tokenizer: Any) -> TokenRows:
    """Documents as token rows the way `cfg` says: packed, or one row per document."""
    bos = special_id(tokenizer, ("bos", "cls"), "dataset.prepend_bos") if cfg.prepend_bos else None
    sep = special_id(tokenizer, ("eos", "sep"), "dataset.pack") if cfg.pack and len(docs) > 1 else 0
    ids = encode(tokenizer, [text for _, _, text in docs])
    sources = [(name, number) for name, number, _ in docs]
    if cfg.pack:
        return _packed(ids, sources, cfg, (sep, bos))
    return _one_per_document(ids, sources, cfg, bos, pad_id(tokenizer))


def _packed(
    ids: list[np.ndarray], sources: list[Source], cfg: TextDatasetConfig, marks: tuple
) -> TokenRows:
    sep, bos = marks
    joined = [piece for doc in ids for piece in (doc, np.array([sep], np.int64))][:-1]
    stream = np.concatenate(joined)
    starts = np.cumsum([0] + [len(doc) + 1 for doc in ids[:-1]])
    lead = int(bos is not None)
    width = cfg.context - lead
    n = len(stream) // width
    if n == 0:
        corpus = os.path.abspath(os.path.expanduser(str(cfg.path)))
        raise HookrunError(
            f"dataset.context: {cfg.context} is longer than all of {corpus} ({len(stream)} "
            f"tokens with separators{', plus a bos' if lead else ''}); valid: a context up to "
            f"{len(stream) + lead}, or dataset.pack=false"
        )
    rows = stream[: n * width].reshape(n, width)
    if lead:
        rows = np.concatenate([np.full((n, 1), bos, np.int64), rows], axis=1)
    first = np.searchsorted(starts, np.arange(n) * width, side="right") - 1
    read = _read_at(cfg.read, cfg.context)
    assert read is not None  # cfg.check() refused a read outside the row
    data = TokenRows(
        rows,
        np.full(n, cfg.context),
        np.full(n, read),
        rows[:, read + 1],
        [sources[k] for k in first],
    )
    data.packing = _Packing(starts, sources, width, lead)
    return data


def _one_per_document(
    ids: list[np.ndarray], sources: list[Source], cfg: TextDatasetConfig, bos: int | None, pad: int
) -> TokenRows:
    lead = np.array([] if bos is None else [bos], np.int64)
    rows = np.full((len(ids), cfg.context), pad, np.int64)
    lengths, reads = np.zeros(len(ids), np.int64), np.zeros(len(ids), np.int64)
    for r, doc in enumerate(ids):
        row = np.concatenate([lead, doc])[: cfg.context]
        rows[r, : len(row)], lengths[r] = row, len(row)
        read = _read_at(cfg.read, len(row))
        if read is None:
            need = 2 if cfg.read == _LAST else max(2, cfg.read + 2 if cfg.read >= 0 else -cfg.read)
            raise HookrunError(
                f"dataset.read: {cfg.read!r} needs rows of {need} tokens or more, but "
                f"{sources[r][0]}:{sources[r][1]} has {len(row)}; valid: documents of "
                f"{need} tokens or more, another dataset.read, or dataset.pack=true"
            )
        reads[r] = read
    return TokenRows(rows, lengths, reads, rows[np.arange(len(ids)), reads + 1], sources)


def check_vocab(data: Dataset, vocab_size: int) -> None:
    """Refuse token data with an id the model has no embedding for (a tokenizer that does
    not match the model), naming the file and line it comes from; other data passes. The
    whole dataset is checked, not only the rows a `limit` keeps."""
    rows = token_rows(data)
    if rows is None:
        return
    past = (rows.ids >= vocab_size).flatten().nonzero()
    if len(past):
        row, column = divmod(int(past[0]), rows.ids.shape[1])
        token = int(rows.ids[row, column])
        padding = column >= int(rows.lengths[row])
        name, line = rows.sources[row] if padding else rows.source_of(row, column)
        what = f"the padding id {token}" if padding else f"token id {token}"
        _past_vocab(f"{name}:{line}: {what}", vocab_size)
    cf_ids = rows.counterfactual_ids or [None] * len(rows)
    cf_answers = rows.counterfactual_answer or [None] * len(rows)
    for r, (name, line) in enumerate(rows.sources):
        extras = (
            ("answer", [int(rows.labels[r])]),
            ("counterfactual", cf_ids[r] or []),
            ("counterfactual_answer", [] if cf_answers[r] is None else [cf_answers[r]]),
        )
        for what, ids in extras:
            if ids and max(ids) >= vocab_size:
                _past_vocab(f"{name}:{line}: the {what}'s token id {max(ids)}", vocab_size)


def _past_vocab(what: str, vocab_size: int) -> None:
    raise HookrunError(
        f"dataset.path: {what} is past the model's vocabulary of {vocab_size}; valid: ids "
        f"below {vocab_size} (the model's own tokenizer)"
    )


DATASETS.register("text")(DatasetKind(TextDatasetConfig, build_text, tokens=True))
