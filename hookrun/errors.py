"""The one exception type users see: bad input, stated as key, value and valid choices (and
Interrupted, a signal's stop, which like KeyboardInterrupt is no Exception)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["HookrunError", "RunFault", "Interrupted", "nearest", "one_line", "first_line"]


class HookrunError(Exception):
    """A problem with the user's input (config, data, weights, paths, devices).

    The message is complete on its own: the CLI prints it as one line, without a traceback,
    and exits with `exit_code`.
    """

    exit_code = 2


class RunFault(HookrunError):
    """The run met a fault of its surroundings (a write error: full disk, file-size limit,
    I/O error). The file keeps every row up to `completed`; `resume=true` continues it."""

    exit_code = 1


class Interrupted(BaseException):
    """SIGTERM or SIGINT stopped the run after the batch in flight; exit status 128 + signal.

    Like KeyboardInterrupt, not an Exception: the signal handler raises it wherever the run
    is computing, also inside a library call that the code around it guards with `except
    Exception` (or `except HookrunError`) to report a bad file in one line. Caught there,
    the interruption became that bad-input error (exit 2, naming the file being read) and
    the run did not stop as interrupted; no such handler can catch it now. Whoever must
    report it catches it by name (`except Interrupted`, as __main__ does)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def nearest(word: str, choices: Iterable[str], n: int = 5) -> list[str]:
    """The choices closest to `word`, best first (for 'did you mean' hints)."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=n, cutoff=0.5)
    if len(close) < n:
        # Substring hits catch what edit distance misses, e.g. 'conv' -> 'features.0.conv'.
        close += [c for c in choices if word and word in c and c not in close][: n - len(close)]
    return close


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` with the choice closest to `word`, or '' when none is close:
    the one spelling of the hint every refusal of an unknown name ends with."""
    hint = nearest(str(word), choices, n=1)
    return f" (did you mean '{hint[0]}'?)" if hint else ""


def unknown_key(key: str, name: object, valid: Iterable[str]) -> HookrunError:
    """The refusal of a key a node does not have: `<key>.<name>: unknown key (did you mean
    ...?); valid keys: ...`."""
    valid = list(valid)
    return HookrunError(
        f"{key}.{name}: unknown key{did_you_mean(name, valid)}; valid keys: {', '.join(valid)}"
    )


def one_line(err: HookrunError | Interrupted) -> str:
    """The message of `err` as one line.

    A HookrunError raised in a DataLoader worker comes back wrapped in the worker's
    traceback text; the original message is its last line.
    """
    text = str(err).strip()
    last = text.splitlines()[-1] if text else ""
    prefix = f"{HookrunError.__module__}.{HookrunError.__name__}: "
    return last.removeprefix(prefix)


def first_line(err: BaseException) -> str:
    """What one line can say of a library's error (h5py, HDF5): its first line, without the
    quotes a KeyError puts around its text; the error's type when it has no text."""
    return (str(err).strip("'\"").splitlines() or [type(err).__name__])[0]
