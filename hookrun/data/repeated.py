"""`dataset=repeated_tokens`: rows of a random token sequence repeated, the data induction
heads are found with (Olsson et al. 2022; hookrun/methods/induction.py scores them).

Row r is a sequence of `length` distinct token ids drawn uniformly without replacement from
the tokenizer's vocabulary less its special tokens, written `repeats` times in a row (a bos
first with `prepend_bos`): T = repeats·length (+1). Every row is drawn from one numpy
generator seeded by the run's `seed`, so a seed gives the same rows everywhere. Distinct
tokens make "the token after its earlier copy" one position. The rows have no padding; the
read position is the second-to-last token and the label the last (like dataset=text's
`read: last`). Each row's source is `repeated_tokens` and its 1-based row number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hookrun.data.kinds import DATASETS, DatasetKind
from hookrun.data.tokens import TokenRows, check_context, special_id
from hookrun.errors import HookrunError
from hookrun.typed import Frozen, check_range

__all__ = ["RepeatedTokensConfig", "build_repeated", "vocabulary", "KIND"]

KIND = "repeated_tokens"  # the kind's name, and every row's source (/samples/path)


@dataclass
class RepeatedTokensConfig(Frozen):
    kind: str = KIND
    # Tokens of the random sequence (distinct ids), and how many times each row repeats it.
    length: int = 25
    repeats: int = 2
    # Rows of the dataset.
    size: int = 64
    # A bos token (else cls) at the start of every row.
    prepend_bos: bool = False

    def check(self) -> None:
        check_range("dataset.length", self.length, 1)
        check_range("dataset.repeats", self.repeats, 1)
        check_range("dataset.size", self.size, 1)
        check_context(self.length * self.repeats + int(self.prepend_bos))
        if self.length * self.repeats + int(self.prepend_bos) < 2:
            raise HookrunError(
                f"dataset.length: {self.length} with repeats {self.repeats} gives rows of one "
                "token; valid: rows of 2 tokens or more (a read position and its next token)"
            )


def vocabulary(tokenizer: Any) -> np.ndarray:
    """The ids a row is drawn from: the tokenizer's vocabulary less its special tokens."""
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def build_repeated(cfg: RepeatedTokensConfig, seed: int, tokenizer: Any) -> TokenRows:
    """`dataset=repeated_tokens`: `size` rows of a seeded random sequence repeated."""
    allowed = vocabulary(tokenizer)
    if len(allowed) < cfg.length:
        raise HookrunError(
            f"dataset.length: {cfg.length} distinct tokens, but the tokenizer has "
            f"{len(allowed)} non-special ones; valid: 1..{len(allowed)}"
        )
    bos = special_id(tokenizer, ("bos", "cls"), "dataset.prepend_bos") if cfg.prepend_bos else None
    rng = np.random.default_rng(seed)
    drawn = np.stack([rng.choice(allowed, size=cfg.length, replace=False) for _ in range(cfg.size)])
    rows = np.tile(drawn, (1, cfg.repeats))
    if bos is not None:
        rows = np.concatenate([np.full((cfg.size, 1), bos, np.int64), rows], axis=1)
    width = rows.shape[1]
    data = TokenRows(
        rows,
        np.full(cfg.size, width),
        np.full(cfg.size, width - 2),
        rows[:, width - 1],
        [(KIND, r + 1) for r in range(cfg.size)],
    )
    data.kind = KIND
    return data


DATASETS.register(KIND)(DatasetKind(RepeatedTokensConfig, build_repeated, tokens=True))
