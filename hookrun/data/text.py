"""`dataset=text`: a corpus as rows of token ids, streamed from its files to a token file.

Documents are read and tokenized a chunk at a time, and their ids go to the run's token
cache (data/token_cache.py: once per job, for its ranks and resumes) or, without one, to an
unlinked temporary file (int32, in Python's temporary folder: TMPDIR, else /tmp; 4 bytes a
token, gone when the process ends, killed or not), never all held in memory: what stays is
a few numbers per document. Rows are read back from the file as the loader asks for them.
`pack: true` joins the documents with the tokenizer's eos (else sep) token into one stream
cut into rows of `context` tokens (the last partial row dropped); `pack: false` gives one
row per document, truncated or right-padded.
The sample, its mask, read marker and label are those of hookrun/data/tokens.py; so are the
fingerprint and the vocabulary check, over the rows read (with `limit`, the corpus is read
only as far as the kept rows need; a run with `limit` started before this (stop 37)
fingerprinted the whole corpus, and is refused on resume as data that changed). Every
refusal of the data happens before the first batch.
"""

from __future__ import annotations

import hashlib
import math
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hookrun.data.corpus import Line, data_files, json_rows, lines, string_field
from hookrun.data.kinds import DATASETS, NO_LABEL, DatasetKind
from hookrun.data.token_cache import cached, corpus_key
from hookrun.data.token_file import TokenFile
from hookrun.data.tokens import (
    LAST,
    Source,
    TokenData,
    Tokenizing,
    check_context,
    encode,
    pad_id,
    read_at,
    read_valid,
    refuse_past_vocab,
    sample_of,
    special_id,
)
from hookrun.errors import HookrunError
from hookrun.typed import Frozen

__all__ = ["TextDatasetConfig", "CorpusRows", "build_text", "field_documents", "text_rows"]

_CHUNK = 1024  # documents per call of the tokenizer
_TOKENS_READ = 1 << 20  # tokens per read when the whole corpus is scanned (fingerprint, vocab)


@dataclass
class TextDatasetConfig(Frozen):
    kind: str = "text"
    path: str | None = None
    """A .txt file (one document per line; blank lines skipped), a .jsonl file (the string `field`
    of each row) or a folder of them (sorted by name). `~` and paths relative to the working
    directory work. null: the experiment's default corpus, where it has one.
    """
    field: str = "text"
    """The string key of each .jsonl row that holds its document."""
    context: int = 128
    """Tokens per row."""
    pack: bool = True
    """true: the documents joined by the tokenizer's eos (else sep) token and cut into full rows of
    `context` tokens, the last partial row dropped; false: one row per document, truncated or
    right-padded to `context` (with its attention mask).
    """
    prepend_bos: bool = False
    """A bos token (else cls) at the start of every row."""
    read: Any = LAST
    """The row's read position: last (the second-to-last real token: the label, its actual next
    token, is the last), or an int i (negative: from the end of the real tokens); the label is
    the token at i + 1.
    """

    def check(self) -> None:
        check_context(self.context)
        if not self.field:
            raise HookrunError("dataset.field: ''; valid: the key of each .jsonl row's text")
        if isinstance(self.read, bool) or not (self.read == LAST or isinstance(self.read, int)):
            raise HookrunError(f"dataset.read: {self.read!r}; valid: {read_valid(self.context)}")
        if read_at(self.read, self.context) is None:
            raise HookrunError(
                f"dataset.read: {self.read} has no next token in a row of {self.context}; "
                f"valid: {read_valid(self.context)}"
            )


@dataclass(frozen=True)
class _Shape:
    """How rows are cut: `width` stream tokens a row behind `bos` (packed), or one row per
    document (width 0); `read` the packed rows' read position; `pad` the padding id."""

    context: int
    width: int
    bos: int | None
    read: int
    pad: int


class CorpusRows(TokenData):
    """Rows of a corpus whose ids live in a TokenFile: packed (one stream) or one per
    document. Per document it keeps its offset in the file, its token count, its source and
    (one row per document) its row's read position."""

    has_labels = True

    def __init__(self, store: TokenFile, docs: dict[str, Any], shape: _Shape, top: int) -> None:
        self.store, self.shape, self.top = store, shape, top
        self.files: list[str] = docs["files"]
        self.starts, self.counts = docs["starts"], docs["counts"]
        self.file_of, self.lines = docs["file_of"], docs["lines"]
        self.reads = docs.get("reads")
        lead = int(shape.bos is not None)
        if shape.width:
            self.rows = store.size // shape.width
            self.padded = False
        else:
            self.rows = len(self.starts)
            self.padded = bool((self.counts + lead < shape.context).any())
        self.kind = "text"
        self.counterfactual_ids = self.counterfactual_answer = None

    def __len__(self) -> int:
        return self.rows

    def real(self, row: int) -> np.ndarray:
        """Row `row`'s real tokens (int64, the bos first where there is one)."""
        shape = self.shape
        lead = [] if shape.bos is None else [shape.bos]
        if shape.width:
            ids = self.store.read(row * shape.width, shape.width)
        else:
            ids = self.store.read(
                int(self.starts[row]), min(int(self.counts[row]), shape.context - len(lead))
            )
        return np.concatenate([np.asarray(lead, np.int64), ids]) if lead else ids

    def read_of(self, row: int) -> int:
        return self.shape.read if self.shape.width else int(self.reads[row])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        if not -self.rows <= index < self.rows:  # the dropped partial row is no row
            raise IndexError(f"row {index} of {self.rows}")
        row = index % self.rows
        real, read = self.real(row), self.read_of(row)
        return sample_of(real, self.shape.context, self.shape.pad, read), int(real[read + 1]), index

    def source_of(self, row: int, column: int) -> Source:
        """The file and line the token at (row, column) comes from (a separator counts as
        its document's; a packed row's bos as its first document's)."""
        doc = row
        if self.shape.width:
            lead = int(self.shape.bos is not None)
            offset = row * self.shape.width + max(column - lead, 0)
            doc = int(np.searchsorted(self.starts, offset, side="right")) - 1
        return self.files[int(self.file_of[doc])], int(self.lines[doc])

    def files_of(self, rows: Sequence[int]) -> set[str]:
        """The source files of `rows` (dataset indices): those their first tokens come from."""
        at = np.asarray(rows, dtype=np.int64)
        if self.shape.width:
            at = np.searchsorted(self.starts, at * self.shape.width, side="right") - 1
        return {self.files[int(i)] for i in np.unique(self.file_of[at])}

    @property
    def sources(self) -> Sequence[Source]:
        """Each row's source: the file and line of its first token."""
        return _Sources(self)

    def missing(self, row: int, fields: tuple[str, ...]) -> str | None:
        """The first of `fields` a text row lacks: it has an answer (its next token) only."""
        return next((name for name in fields if name != "answer"), None)

    def counterfactual_answers(self) -> torch.Tensor:
        return torch.full((self.rows,), NO_LABEL, dtype=torch.int64)

    def _blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, the rows' ids padded to context (m, T)) over the whole corpus."""
        shape = self.shape
        step = max(1, _TOKENS_READ // shape.context)  # memory flat in the context too
        for first in range(0, self.rows, step):
            m = min(step, self.rows - first)
            if shape.width:
                block = self.store.read(first * shape.width, m * shape.width).reshape(m, -1)
                if shape.bos is not None:
                    block = np.concatenate([np.full((m, 1), shape.bos, np.int64), block], axis=1)
            else:
                block = np.full((m, shape.context), shape.pad, np.int64)
                for k in range(m):
                    real = self.real(first + k)
                    block[k, : len(real)] = real
            yield first, block

    def _lengths_reads(self) -> tuple[np.ndarray, np.ndarray]:
        shape, lead = self.shape, int(self.shape.bos is not None)
        if shape.width:
            return np.full(self.rows, shape.context), np.full(self.rows, shape.read)
        return np.minimum(self.counts + lead, shape.context), np.asarray(self.reads)

    def fingerprint(self) -> str:
        """sha256 over every row's ids, length, read position, label and source: the bytes
        TokenRows.fingerprint hashes for the same rows."""
        digest, labels = hashlib.sha256(), []
        lengths, reads = self._lengths_reads()
        for first, block in self._blocks():
            digest.update(block.tobytes())
            labels.append(block[np.arange(len(block)), reads[first : first + len(block)] + 1])
        for part in (lengths, reads, np.concatenate(labels) if labels else np.zeros(0)):
            digest.update(np.asarray(part, dtype=np.int64).tobytes())
        digest.update(b"[")
        for row in range(self.rows):
            digest.update((", " if row else "").encode() + repr(self.sources[row]).encode())
        digest.update(b"]")
        return digest.hexdigest()

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse an id the model has no embedding for, naming the file and line of the
        first one (row by row); the corpus is scanned only when one exists."""
        shape = self.shape
        specials = [shape.bos] if shape.bos is not None else []
        specials += [shape.pad] if self.padded else []
        if max([self.top, *specials]) < vocab_size:
            return
        lengths, _ = self._lengths_reads()
        for first, block in self._blocks():
            refuse_past_vocab(block, first, lengths, vocab_size, self.source_of)


class _Sources(Sequence):
    """CorpusRows.sources: each row's source, computed when asked."""

    def __init__(self, rows: CorpusRows) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, row: Any) -> Any:
        if isinstance(row, slice):
            return [self[r] for r in range(*row.indices(len(self)))]
        if not -len(self) <= row < len(self):
            raise IndexError(row)
        return self._rows.source_of(row % len(self), 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def _documents(file: Path, field: str) -> Iterator[Line]:
    """The documents of one file, one by one: its lines (.txt) or each row's `field`
    (.jsonl); a file with none is refused once it has been read to its end."""
    found = lines(file) if file.suffix == ".txt" else field_documents(json_rows(file), field)
    empty = True
    for doc in found:
        empty = False
        yield doc
    if empty:
        raise HookrunError(
            f"dataset.path: {file} is empty (no documents); valid: a file with a document"
        )


def field_documents(rows: Iterable[tuple[str, int, dict[str, Any]]], field: str) -> Iterator[Line]:
    """The string `field` of each (source, number, row) as a document, blank ones skipped;
    a row without it (absent or null) is refused, naming its source and number."""
    for name, number, row in rows:
        text = string_field(row, field, (name, number), "dataset.field")
        if text is None and field in row:
            raise HookrunError(
                f"dataset.field: {field!r} is null at {name}:{number}; valid: a string in every row"
            )
        if text is None:
            raise HookrunError(
                f"dataset.field: {field!r} is missing from {name}:{number}; valid: a key "
                f"of every row (this one has: {', '.join(map(str, row)) or 'none'})"
            )
        if text.strip():
            yield name, number, text


def build_text(cfg: TextDatasetConfig, seed: int, tokenizing: Tokenizing) -> CorpusRows:
    """`dataset=text`: the files in name order, each document refused or tokenized in turn
    (kept in the run's token cache, when the run has one, for its ranks and its resumes)."""
    files = data_files(cfg.path, (".txt", ".jsonl"), True)
    docs = (doc for file in files for doc in _documents(file, cfg.field))
    return text_rows(docs, cfg, tokenizing, files)


def text_rows(
    docs: Iterable[Line],
    cfg: TextDatasetConfig,
    tokenizing: Tokenizing,
    corpus: list[Path] | None = None,
) -> CorpusRows:
    """Documents as token rows the way `cfg` says: packed, or one row per document. With
    `tokenizing.limit`, the documents are read only as far as the rows need; with the
    `corpus` files they come from and `tokenizing.cache`, the ids are kept there."""
    tokenizer = tokenizing.tokenizer
    bos = special_id(tokenizer, ("bos", "cls"), "dataset.prepend_bos") if cfg.prepend_bos else None
    lead = int(bos is not None)
    limit = tokenizing.limit
    # Packed: the stream tokens `limit` rows hold (the last one whole); else `limit` docs.
    enough = None if limit is None else (limit * (cfg.context - lead) if cfg.pack else limit)

    def tokenize(store: TokenFile) -> dict[str, Any]:
        seen, read = _Seen(), iter(docs)
        while enough is None or (store.size if cfg.pack else len(seen.starts)) < enough:
            chunk = list(islice(read, _chunk_size(enough, cfg.pack, store.size, len(seen.starts))))
            if not chunk:
                break
            for (name, number, _), ids in zip(
                chunk, encode(tokenizer, [t for *_, t in chunk]), strict=True
            ):
                if cfg.pack and seen.starts:  # a separator before every document but the first
                    seen.sep = special_id(tokenizer, ("eos", "sep"), "dataset.pack")
                    store.append(np.array([seen.sep]))
                seen.add(name, number, store.size, ids)
                store.append(ids)
        store.done()
        return seen.arrays()

    if tokenizing.cache is not None and corpus is not None:
        settings = {"field": cfg.field, "pack": cfg.pack, "rows": enough}
        key = corpus_key(corpus, tokenizer, settings)
        store, docs_of = cached(tokenizing.cache, key, tokenize)
    else:
        store = TokenFile()
        docs_of = tokenize(store)
    if not len(docs_of["starts"]):
        corpus_path = os.path.abspath(os.path.expanduser(str(cfg.path)))
        raise HookrunError(
            f"dataset.path: {corpus_path} is empty (no documents); valid: a document"
        )
    top = max(int(docs_of["top"]), -1 if docs_of["sep"] is None else int(docs_of["sep"]))
    if not cfg.pack:
        docs_of["reads"] = _reads(docs_of, cfg, lead)
        return CorpusRows(store, docs_of, _Shape(cfg.context, 0, bos, 0, pad_id(tokenizer)), top)
    width = cfg.context - lead
    if store.size < width:
        corpus_path = os.path.abspath(os.path.expanduser(str(cfg.path)))
        raise HookrunError(
            f"dataset.context: {cfg.context} is longer than all of {corpus_path} ({store.size} "
            f"tokens with separators{', plus a bos' if lead else ''}); valid: a context up to "
            f"{store.size + lead}, or dataset.pack=false"
        )
    read = read_at(cfg.read, cfg.context)
    assert read is not None  # cfg.check() refused a read outside the row
    return CorpusRows(store, docs_of, _Shape(cfg.context, width, bos, read, 0), top)


def _chunk_size(enough: int | None, pack: bool, tokens: int, docs: int) -> int:
    """Documents to tokenize next: _CHUNK, or with a limit no more than it still needs —
    packed, by the tokens a document has had so far (16 to learn that)."""
    if enough is None:
        return _CHUNK
    if not pack:
        return min(_CHUNK, enough - docs)
    if not docs:
        return 16
    return min(_CHUNK, max(1, math.ceil((enough - tokens) * docs / max(tokens, 1))))


class _Seen:
    """What text_rows keeps of each document: its offset, token count and source."""

    def __init__(self) -> None:
        self.starts, self.counts, self.file_of, self.lines = (array("q") for _ in range(4))
        self.files: dict[str, int] = {}
        self.sep: int | None = None
        self.top = -1

    def add(self, name: str, number: int, offset: int, ids: np.ndarray) -> None:
        self.starts.append(offset)
        self.counts.append(len(ids))
        self.file_of.append(self.files.setdefault(name, len(self.files)))
        self.lines.append(number)
        if len(ids):
            self.top = max(self.top, int(ids.max()))

    def arrays(self) -> dict[str, Any]:
        out: dict[str, Any] = {"files": list(self.files), "sep": self.sep, "top": self.top}
        for name in ("starts", "counts", "file_of", "lines"):
            out[name] = np.frombuffer(getattr(self, name), dtype=np.int64)
        return out


def _reads(docs: dict[str, Any], cfg: TextDatasetConfig, lead: int) -> np.ndarray:
    """One row per document: each row's read position; a row too short for it is refused."""
    lengths = np.minimum(docs["counts"] + lead, cfg.context)
    reads = np.zeros(len(lengths), np.int64)
    for r, length in enumerate(lengths.tolist()):
        read = read_at(cfg.read, length)
        if read is None:
            need = 2 if cfg.read == LAST else max(2, cfg.read + 2 if cfg.read >= 0 else -cfg.read)
            name, line = docs["files"][int(docs["file_of"][r])], int(docs["lines"][r])
            raise HookrunError(
                f"dataset.read: {cfg.read!r} needs rows of {need} tokens or more, but "
                f"{name}:{line} has {length}; valid: documents of "
                f"{need} tokens or more, another dataset.read, or dataset.pack=true"
            )
        reads[r] = read
    return reads


DATASETS.register("text")(DatasetKind(TextDatasetConfig, build_text, tokens=True))
