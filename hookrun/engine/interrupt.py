"""SIGTERM and SIGINT during a run: finish the batch in flight, then stop cleanly.

The handlers only note the signal; the batch loop checks the note before it fetches the next
batch (`until_signal`), so the batch being computed completes, the writer flushes every
queued batch, the file is marked `interrupted` with the signal as its reason, and every hook
comes off on the way out. A second signal gets the handler that was there before (Python's
KeyboardInterrupt for SIGINT, immediate termination for SIGTERM): the file is then left
`running`, which `resume=true` continues just the same.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from hookrun.errors import Interrupted

__all__ = ["signals_caught", "stop_if_signalled", "until_signal"]

T = TypeVar("T")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_caught: list[int] = []  # signals are process-wide, so is this note


@contextmanager
def signals_caught() -> Iterator[None]:
    """Catch SIGTERM/SIGINT for the block (only the main thread may; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, object] = {}

    def note(signum: int, frame: object) -> None:
        _caught.append(signum)
        signal.signal(signum, previous[signum])  # a second one acts at once

    _caught.clear()
    for signum in _SIGNALS:
        previous[signum] = signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _caught.clear()


def stop_if_signalled() -> None:
    """Raise Interrupted (exit status 128 + signal) once a signal was caught."""
    if _caught:
        signum = _caught[0]
        name = signal.Signals(signum).name
        raise Interrupted(
            f"interrupted by {name}: every batch computed before it is written and the file "
            "is marked interrupted; continue it with resume=true",
            signum,
        )


def until_signal(batches: Iterable[T]) -> Iterator[T]:
    """The batches, until a signal is caught (checked before each batch is fetched)."""
    it = iter(batches)
    while True:
        stop_if_signalled()
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch
