"""The next chunk of streamed activations made while the steps run on this one (`sae.prefetch`).

A thread runs the model's forward passes for the chunk after the current one; the main
thread steps the dictionaries. The chunk is the one `ModelActivations.chunk` makes from the
same start (the same model batches, the same numbers), so a job with prefetch ends at the
weights of one without, and a checkpoint names the chunk being stepped on as before: a
prefetched chunk is only thrown away on a stop, and made again by a resumed job.

On a GPU the thread's passes go to a CUDA stream of their own, and the chunk is handed over
behind an event: the model's kernels and the dictionaries' overlap. On the CPU the two share
the cores (worth it only where they are not all busy: `auto` leaves it off there).

Signals: the thread never takes one (Python runs handlers in the main thread), and it leaves
the signal module's regions alone. The main thread waits for a chunk in short polls inside
`interruptible()`, so a signal stops the wait at once; closing sets the thread's stop flag,
which it reads before each model batch, and joins it (one model batch at most) before the
job goes on to its checkpoint: no thread is left running into the process's exit.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from hookrun.signals import interruptible
from hookrun.training.sources import ModelActivations, Position

__all__ = ["Prefetch", "wanted"]

# How long a wait for the thread runs before Python looks at signals again.
_POLL_S = 0.05


def wanted(setting: str, device: torch.device, data_parallel: bool) -> bool:
    """Whether a streamed job prefetches: `auto` on a GPU in one process; `true` anywhere
    in one process (the parse refuses it under torchrun, whose collectives the thread's
    chunk would interleave with the steps')."""
    if data_parallel:
        return False
    if setting == "auto":
        return device.type == "cuda"
    return setting == "true"


class Prefetch:
    """At most one chunk in the making: `start(at, tokens)`, then `take()` it."""

    def __init__(self, source: ModelActivations, device: torch.device) -> None:
        self.source, self.device = source, device
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start: Position | None = None
        self._made: Any = None  # (vectors, after) or the exception the thread raised
        self._event: Any = None  # CUDA: recorded on the thread's stream after the chunk

    def start(self, at: Position, tokens: int) -> None:
        """Make the chunk of `tokens` tokens from `at` in the thread."""
        self.close()
        self._stop.clear()
        self._start, self._made, self._event = at, None, None
        self._thread = threading.Thread(
            target=self._make, args=(at, tokens), name="hookrun-prefetch"
        )
        self._thread.start()

    def holds(self, at: Position) -> bool:
        """Whether the chunk in the making starts at `at`."""
        return self._thread is not None and self._start == at

    def _make(self, at: Position, tokens: int) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            if stream is None:
                self._made = self.source.make_chunk(at, tokens, self._stop.is_set)
            else:
                with torch.cuda.stream(stream):
                    self._made = self.source.make_chunk(at, tokens, self._stop.is_set)
                    self._event = stream.record_event()
        except BaseException as err:  # handed to the main thread by take()
            self._made = err

    def take(self) -> tuple[list[torch.Tensor], Position]:
        """The chunk, once made (interruptible: a signal stops the wait); the thread's
        error raised here."""
        thread = self._thread
        assert thread is not None, "take() before start()"
        with interruptible():
            while thread.is_alive():
                thread.join(_POLL_S)
        self._thread, self._start = None, None
        made = self._made
        self._made = None
        if isinstance(made, BaseException):
            raise made
        vectors, after = made
        if self._event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self._event)
            for v in vectors:  # freed only once this stream's work on them is done
                v.record_stream(current)
        return vectors, after

    def close(self) -> None:
        """Give up the chunk in the making, the thread joined."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        while thread.is_alive():  # polls: a signal's handler still runs meanwhile
            thread.join(_POLL_S)
        self._thread, self._start, self._made, self._event = None, None, None, None
