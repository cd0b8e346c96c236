"""The one exception type users see: bad input, stated as key, value and valid choices."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["HookrunError", "nearest"]


class HookrunError(Exception):
    """A problem with the user's input (config, data, weights, paths, devices).

    The message is complete on its own: the CLI prints it as one line, without a traceback.
    """


def nearest(word: str, choices: Iterable[str], n: int = 5) -> list[str]:
    """The choices closest to `word`, best first (for 'did you mean' hints)."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=n, cutoff=0.5)
    if len(close) < n:
        # Substring hits catch what edit distance misses, e.g. 'conv' -> 'features.0.conv'.
        close += [c for c in choices if word and word in c and c not in close][: n - len(close)]
    return close
