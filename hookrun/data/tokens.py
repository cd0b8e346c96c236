"""Token data for language models: what every token kind shares — the sample, the read
position, the vocabulary check — and TokenRows, the rows held in memory (dataset=prompts,
dataset=repeated_tokens). dataset=text streams its corpus instead (hookrun/data/text.py).

Item i is (tensor, label, i). `tensor` is int64 (3, T), T one length for the whole dataset:
row 0 the token ids (padding holds the tokenizer's pad id, else its eos, else 0), row 1 the
attention mask (1 for a real token; padding always on the right, so real tokens keep their
positions), row 2 the read marker (1 at the one real position whose next-token logits are
the row's output). `label` is the target token (the actual next token after the read
position for text, the first token of the answer for prompts) or NO_LABEL.

A token dataset (a TokenData) says `tokens` (True), `kind` (text, prompts or
repeated_tokens: what a target.kind reads), `has_labels`, `padded` (whether any row has
padding) and `sources` (per row: absolute source file and 1-based line; dataset=hf_disk:
its folder and 0-based row). The kinds are built
as `build(cfg, seed, tokenizer)`; every refusal of the data happens there, before the first
batch, except a token id past the model's vocabulary: `check_vocab(data, vocab_size)`, once
the model is built.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from hookrun.data.kinds import NO_LABEL
from hookrun.errors import HookrunError
from hookrun.memory import check_fits
from hookrun.typed import check_range

__all__ = [
    "Tokenizing",
    "LAST",
    "Numbered",
    "Source",
    "TokenData",
    "TokenRows",
    "check_vocab",
    "past_vocab",
    "refuse_past_vocab",
    "read_at",
    "read_valid",
    "sample_of",
    "token_rows",
    "check_context",
    "special_id",
    "pad_id",
    "encode",
]

_ID = 8  # bytes of one int64 token id
_CHUNK = 1024  # texts per call of the tokenizer
_SOURCES = 65536  # rows' sources hashed at a time
LAST = "last"
Source = tuple[str, int]  # (absolute path, 1-based line)


def check_context(context: int) -> None:
    """`dataset.context`: two tokens or more (a read position and its next token), and a row
    that fits in memory."""
    check_range("dataset.context", context, 2)
    check_fits("dataset.context", context, 3 * _ID * context, f"one row [3, {context}]")


def read_at(read: Any, length: int) -> int | None:
    """The read position in a row of `length` real tokens (None where the row is too short
    for it): `last` is the second-to-last token, an int i is i, from the end when negative;
    the token after it must be real too (it is the label)."""
    pos = length - 2 if read == LAST else (read if read >= 0 else length + read)
    return pos if 0 <= pos <= length - 2 else None


def read_valid(context: int) -> str:
    return f"last, or an integer from 0 to {context - 2} or from -{context} to -2"


class TokenData(Dataset):
    """What every token dataset is (token_rows finds it under a `limit`'s Subset)."""

    tokens = True
    kind = "text"
    # Whether each row's source names a file (its /samples/path is that file's absolute
    # path); a generated dataset's source is its own name, the same from every folder.
    from_files = True


def sample_of(real: np.ndarray, context: int, pad: int, read: int) -> torch.Tensor:
    """The (3, context) sample of a row whose real tokens are `real`: the ids right-padded
    with `pad`, the attention mask, and the read marker at `read`."""
    sample = torch.zeros((3, context), dtype=torch.int64)
    sample[0] = pad
    sample[0, : len(real)] = torch.from_numpy(np.asarray(real, dtype=np.int64))
    sample[1, : len(real)] = 1
    sample[2, read] = 1
    return sample


class Numbered(Sequence):
    """The sources of rows that all come from one place, numbered from 1 (repeated tokens:
    `(repeated_tokens, r + 1)`), made when asked instead of a tuple a row."""

    def __init__(self, name: str, count: int) -> None:
        self.name, self.count = name, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, row: Any) -> Any:
        if isinstance(row, slice):
            return [self[r] for r in range(*row.indices(self.count))]
        if not -self.count <= row < self.count:
            raise IndexError(row)
        return (self.name, row % self.count + 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def joined(self, lo: int, hi: int) -> str:
        """`", ".join(map(repr, self[lo:hi]))`, without making the tuples (for hashing)."""
        prefix = repr((self.name, 0))[:-2].replace("{", "{{").replace("}", "}}")
        return ", ".join(map(f"{prefix}{{}})".format, range(lo + 1, min(hi, self.count) + 1)))


def _joined(sources: Sequence[Source], lo: int, hi: int) -> str:
    """The reprs of sources[lo:hi], comma-separated, as repr of their list writes them."""
    if isinstance(sources, Numbered):
        return sources.joined(lo, hi)
    return ", ".join(map(repr, sources[lo:hi]))


class TokenRows(TokenData):
    """Rows of token ids held in memory, each with its number of real tokens, read position
    and label."""

    def __init__(
        self,
        ids: np.ndarray,
        lengths: np.ndarray,
        reads: np.ndarray,
        labels: np.ndarray | None,
        sources: Sequence[Source],
    ) -> None:
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        self.lengths = torch.from_numpy(np.asarray(lengths, dtype=np.int64))
        self.reads = torch.from_numpy(np.asarray(reads, dtype=np.int64))
        self.has_labels = labels is not None
        given = np.full(len(sources), NO_LABEL) if labels is None else labels
        self.labels = torch.from_numpy(np.ascontiguousarray(given, dtype=np.int64))
        self.sources = sources
        self.padded = bool((self.lengths < self.ids.shape[1]).any())
        # What the rows are (what a target.kind reads): prompts or repeated_tokens.
        self.kind = "prompts"
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
        """The file and line the token at (row, column) comes from: the row's."""
        return self.sources[row]

    def files_of(self, rows: Sequence[int]) -> set[str]:
        """The source files of `rows` (dataset indices)."""
        if isinstance(self.sources, Numbered):
            return {self.sources.name} if len(rows) else set()
        return {self.sources[i][0] for i in rows}

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

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse an id past `vocab_size`, in the rows or the answers and counterfactuals."""
        ids = self.ids.numpy()
        if len(ids) and int(ids.max()) >= vocab_size:
            refuse_past_vocab(ids, 0, self.lengths.numpy(), vocab_size, self.source_of)
        # The first row with an extra id past the vocabulary, named as before row by row:
        # answers are checked at once, counterfactuals (prompts only) row by row before it.
        labels = self.labels.numpy()
        cf_ids, cf_answers = self.counterfactual_ids, self.counterfactual_answer

        def extras(r: int) -> tuple[tuple[str, list[int]], ...]:
            answer = cf_answers[r] if cf_answers else None
            return (
                ("answer", [int(labels[r])]),
                ("counterfactual", (cf_ids[r] if cf_ids else None) or []),
                ("counterfactual_answer", [] if answer is None else [answer]),
            )

        past = np.flatnonzero(labels >= vocab_size)
        first = int(past[0]) if len(past) else len(self)
        rows = range(first) if cf_ids or cf_answers else range(0)
        past_in = (r for r in rows if any(max(x) >= vocab_size for _, x in extras(r) if x))
        first = next(past_in, first)
        if first == len(self):
            return
        name, line = self.sources[first]
        for what, found in extras(first):
            if found and max(found) >= vocab_size:
                past_vocab(f"{name}:{line}: the {what}'s token id {max(found)}", vocab_size)

    def fingerprint(self) -> str:
        """sha256 over every row's tokens, mask length, read position, label and source, and
        (prompts that have them: what patching and target.kind=logit_diff read) its
        counterfactual and counterfactual answer."""
        digest = hashlib.sha256()
        for part in (self.ids, self.lengths, self.reads, self.labels):
            digest.update(np.ascontiguousarray(part.numpy()))  # no copy: they are
        # The bytes of repr(list(self.sources)), a block of rows at a time.
        digest.update(b"[")
        for lo in range(0, len(self), _SOURCES):
            block = _joined(self.sources, lo, lo + _SOURCES)
            digest.update(((", " if lo else "") + block).encode())
        digest.update(b"]")
        others = (self.counterfactual_ids or [], self.counterfactual_answer or [])
        if any(x is not None for column in others for x in column):  # else as before
            digest.update(repr(others).encode())
        return digest.hexdigest()


@dataclass(frozen=True)
class Tokenizing:
    """What a token kind's build gets beside its config: the language model's tokenizer, the
    rows the run keeps (`limit`; None: all: a corpus is read only as far as they need) and
    the folder where the run keeps its tokenized corpus for its ranks and its resumes (None:
    a temporary file of this process)."""

    tokenizer: Any
    limit: int | None = None
    cache: Path | None = None


def token_rows(data: Dataset) -> TokenData | None:
    """The token dataset under `data` (through the Subsets that `limit` makes), else None."""
    while isinstance(data, Subset):
        data = data.dataset
    return data if isinstance(data, TokenData) else None


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


def check_vocab(data: Dataset, vocab_size: int) -> None:
    """Refuse token data with an id the model has no embedding for (a tokenizer that does
    not match the model), naming the file and line it comes from; other data passes. Every
    row built is checked, not only the rows a `limit` keeps (a corpus is built only as far
    as `limit` needs, data/text.py)."""
    rows = token_rows(data)
    if rows is not None:
        rows.check_vocab(vocab_size)  # type: ignore[attr-defined]


def refuse_past_vocab(
    block: np.ndarray, first: int, lengths: np.ndarray, vocab_size: int, source_of: Any
) -> None:
    """Refuse the first id past `vocab_size` in `block` (rows `first`…, padded (m, T)),
    naming the file and line its token comes from (`source_of(row, column)`; padding: its
    row's), or return."""
    past = (block >= vocab_size).flatten().nonzero()[0]
    if len(past):
        k, column = divmod(int(past[0]), block.shape[1])
        row, token = first + k, int(block[k, column])
        padding = column >= int(lengths[row])
        name, line = source_of(row, 0 if padding else column)
        what = f"the padding id {token}" if padding else f"token id {token}"
        past_vocab(f"{name}:{line}: {what}", vocab_size)


def past_vocab(what: str, vocab_size: int) -> None:
    raise HookrunError(
        f"dataset.path: {what} is past the model's vocabulary of {vocab_size}; valid: ids "
        f"below {vocab_size} (the model's own tokenizer)"
    )
