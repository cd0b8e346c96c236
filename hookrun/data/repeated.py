"""`dataset=repeated_tokens`: rows of a random token sequence repeated, the data induction
heads are found with (Olsson et al. 2022; hookrun/stages/induction/scores.py scores them).

Row r is a sequence of `length` distinct token ids drawn uniformly without replacement from
the tokenizer's vocabulary less its special tokens, written `repeats` times in a row (a bos
first with `prepend_bos`): T = repeats·length (+1). Every row is drawn from one numpy
generator seeded by the run's `seed`, so a seed gives the same rows everywhere. Distinct
tokens make "the token after its earlier copy" one position. The rows have no padding; the
read position is the second-to-last token and the label the last (like dataset=text's
`read: last`). Each row's source is `repeated_tokens` and its 1-based row number.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from hookrun.data.kinds import DATASETS, DatasetKind
from hookrun.data.tokens import Numbered, Tokenizing, TokenRows, special_id
from hookrun.errors import HookrunError
from hookrun.memory import check_fits
from hookrun.typed import Frozen, check_range

__all__ = ["RepeatedTokensConfig", "build_repeated", "vocabulary", "KIND"]

KIND = "repeated_tokens"  # the kind's name, and every row's source (/samples/path)
_ID = 8  # bytes of one int64 token id
_CHUNK = 65536  # rows drawn before they are mapped to token ids
_LARGE = 1_000_000  # rows from which drawing them is logged (about 5 s a million)
log = logging.getLogger("hookrun")


@dataclass
class RepeatedTokensConfig(Frozen):
    kind: str = KIND
    length: int = 25
    """Tokens of the random sequence (distinct ids), and how many times each row repeats it."""
    repeats: int = 2
    """How many times each row's random tokens are written one after the other."""
    size: int = 64
    """Rows of the dataset."""
    prepend_bos: bool = False
    """A bos token (else cls) at the start of every row."""

    def width(self) -> int:
        """Tokens a row: `repeats` copies of `length` tokens, and the bos."""
        return self.length * self.repeats + int(self.prepend_bos)

    def check(self) -> None:
        check_range("dataset.length", self.length, 1)
        check_range("dataset.repeats", self.repeats, 1)
        check_range("dataset.size", self.size, 1)
        width = self.width()
        # Blame the factor that makes one row too long, then the rows' count.
        key = "length" if self.length >= self.repeats else "repeats"
        check_fits(f"dataset.{key}", getattr(self, key), 3 * _ID * width, f"one row [3, {width}]")
        if width < 2:
            raise HookrunError(
                f"dataset.length: {self.length} with repeats {self.repeats} gives rows of one "
                "token; valid: rows of 2 tokens or more (a read position and its next token)"
            )
        # The rows are drawn into one int64 array before the first batch (build_repeated).
        rows = f"the rows [{self.size}, {width}] of int64 token ids"
        check_fits("dataset.size", self.size, _ID * self.size * width, rows)


def vocabulary(tokenizer: Any) -> np.ndarray:
    """The ids a row is drawn from: the tokenizer's vocabulary less its special tokens."""
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def build_repeated(cfg: RepeatedTokensConfig, seed: int, tokenizing: Tokenizing) -> TokenRows:
    """`dataset=repeated_tokens`: `size` rows of a seeded random sequence repeated, drawn
    into one array (each row's sequence is the next `rng.choice(allowed, length,
    replace=False)` of one generator)."""
    tokenizer = tokenizing.tokenizer
    allowed = vocabulary(tokenizer)
    if len(allowed) < cfg.length:
        raise HookrunError(
            f"dataset.length: {cfg.length} distinct tokens, but the tokenizer has "
            f"{len(allowed)} non-special ones; valid: 1..{len(allowed)}"
        )
    bos = special_id(tokenizer, ("bos", "cls"), "dataset.prepend_bos") if cfg.prepend_bos else None
    start, width = int(bos is not None), cfg.width()
    if cfg.size >= _LARGE:
        log.info("dataset.size: drawing %d rows of %d tokens", cfg.size, width)
    rows = np.empty((cfg.size, width), np.int64)
    if bos is not None:
        rows[:, 0] = bos
    sequence = rows[:, start : start + cfg.length]
    rng = np.random.default_rng(seed)
    draw, count = rng.choice, len(allowed)
    for lo in range(0, cfg.size, _CHUNK):
        block = sequence[lo : lo + _CHUNK]
        for r in range(len(block)):
            # The same draws as rng.choice(allowed, ...): indices into `allowed`.
            block[r] = draw(count, cfg.length, replace=False)
        block[...] = allowed[block]
    for k in range(1, cfg.repeats):
        rows[:, start + k * cfg.length : start + (k + 1) * cfg.length] = sequence
    data = TokenRows(
        rows,
        np.full(cfg.size, width),
        np.full(cfg.size, width - 2),
        rows[:, width - 1],
        Numbered(KIND, cfg.size),
    )
    data.kind = KIND
    data.from_files = False  # /samples/path says `repeated_tokens`, from any folder
    return data


DATASETS.register(KIND)(DatasetKind(RepeatedTokensConfig, build_repeated, tokens=True))
