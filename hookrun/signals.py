"""SIGTERM and SIGINT during a run: stop within moments, wherever the run is, and leave a
file that resumes.

The handlers note the signal. Where the run is computing (`interruptible()`: building the data
and the model, the probe, a batch's passes, drawing pictures) they stop it at once by raising
Interrupted there: what a batch in flight computed is not in the file yet, so dropping it
loses nothing (`resume=true` computes it again). Elsewhere — queuing a batch to the writer,
closing the file, taking hooks off, putting weights back (`deferred()`) — the signal waits
until that step is done, then stops the run at its next check (`stop_if_signalled`, before
each batch). Either way the writer flushes every queued batch, the file is marked
`interrupted` with the signal as its reason, and every hook comes off on the way out. A second
signal gets the handler that was there before (Python's KeyboardInterrupt for SIGINT,
immediate termination for SIGTERM): the file is then left `running`, which `resume=true`
continues just the same.

Python runs a signal's handler only between bytecodes of the main thread, so "at once" means
"at the next line of Python". A forward pass runs Python at every module call (torch's
`Module.__call__`); a backward pass runs none (one call into autograd's C++ engine: 9.5 s of
one integrated-gradients pass on two busy cores), so it gets a `check()` before each node of
its graph (runtime/interrupts.py, for every model under the run's `run_mode`). One long C
call cannot be stopped: the work keeps each one short (no dense eigenproblem where a
tridiagonal one will do: stages/derive/integrated.py), or runs it in a child process
(`run_in_child`: ROAD's sparse solves of large images) that a signal stops by killing it.
A thread would not do: a daemon thread still inside numpy or SciPy when the process exits
hangs OpenBLAS's exit handler or breaks the interpreter's teardown (seen: exit 120).
"""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from hookrun.errors import Interrupted

__all__ = [
    "signals_caught",
    "stop_if_signalled",
    "check",
    "run_in_child",
    "until_signal",
    "interruptible",
    "deferred",
    "signal_blamed",
]

T = TypeVar("T")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_caught: list[int] = []  # signals are process-wide, so is this note


class _Regions:
    """Where the main thread is: inside how many interruptible and deferred regions, and
    whether the caught signal was already raised (it is raised once: the unwinding it
    starts runs clean-up code that must not be cut short by it again)."""

    interruptible = 0
    deferred = 0
    raised = False


def _raise_now() -> None:
    if _caught and not _Regions.raised:
        _Regions.raised = True
        stop_if_signalled()


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
        if _Regions.interruptible and not _Regions.deferred:
            _raise_now()  # computing: stop here, the work in flight is not in the file yet

    _caught.clear()
    _Regions.raised = False
    for signum in _SIGNALS:
        previous[signum] = signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _caught.clear()
        _Regions.raised = False


@contextmanager
def interruptible() -> Iterator[None]:
    """Work a signal stops at once: nothing it does is in the file until it returns."""
    _Regions.interruptible += 1
    try:
        if not _Regions.deferred:
            _raise_now()  # a signal caught just before
        yield
    finally:
        _Regions.interruptible -= 1


@contextmanager
def deferred() -> Iterator[None]:
    """Clean-up a signal must not cut short (hooks coming off, flags and weights put back):
    a signal caught inside is acted on once it is done, when it ends inside interruptible
    work; elsewhere at the next check."""
    _Regions.deferred += 1
    try:
        yield
    finally:
        _Regions.deferred -= 1
    if not _Regions.deferred and _Regions.interruptible:
        _raise_now()


def stop_if_signalled() -> None:
    """Raise Interrupted (exit status 128 + signal) once a signal was caught."""
    if _caught:
        _Regions.raised = True
        signum = _caught[0]
        name = signal.Signals(signum).name
        # What it left is said by the run once its clean-up is done (pipeline/runner.py).
        raise Interrupted(f"interrupted by {name}", signum)


def check() -> None:
    """Raise Interrupted here if a signal was caught and this is interruptible work (not
    deferred clean-up); otherwise nothing (a check costs one list test). For code that runs
    where no other Python would let the handler act: a backward pass's graph nodes."""
    if _caught and _Regions.interruptible and not _Regions.deferred:
        _raise_now()


# How long the parent waits on its child before it runs Python again: a signal that another
# thread received marks the main thread's next bytecode, which a wait without end would not
# reach.
_POLL_S = 0.05


def run_in_child(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a forked child while this process waits where a signal stops it (the
    child is then killed): for one long C call nothing else could cut short. The child
    shares this process's memory as it was (nothing is sent to it) and sends back the
    result, pickled; `fn` must touch no torch or HDF5 state (other threads' locks are held
    forever in the child). Outside interruptible work, or off the main thread, a plain
    call."""
    main = threading.current_thread() is threading.main_thread()
    if not (_Regions.interruptible and main and hasattr(os, "fork")):
        return fn(*args)
    readable, writable = os.pipe()
    chunks: list[bytes] = []
    pid = None
    try:
        # Deferred across the fork: a handler raising inside os.fork's at-fork hooks is
        # "ignored" there and leaves logging's module lock held (the run then hung on its
        # next log line, seen in CI). Masking the signals would not do: another thread can
        # take one and the handler still runs here. One caught meanwhile is raised as the
        # region ends, inside this try, which kills the child.
        with deferred():
            pid = os.fork()
            if pid == 0:
                _child(fn, args, readable, writable)  # never returns
            os.close(writable)
        while True:
            if select.select([readable], [], [], _POLL_S)[0]:  # a signal's handler runs here
                chunk = os.read(readable, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            check()
    except BaseException:
        if pid:
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(readable)
        if pid:
            _, status = os.waitpid(pid, 0)
    if not chunks:  # killed, by the job's own SIGTERM (then that stops this run) or else
        check()
        raise RuntimeError(f"run_in_child: the child of {fn.__name__} died (status {status})")
    ok, value = pickle.loads(b"".join(chunks))
    if not ok:
        raise value
    return value


def _child(fn: Callable[..., Any], args: tuple, readable: int, writable: int) -> None:
    try:
        # No finaliser of the parent's objects may run here: h5py's take a lock that the
        # writer thread, absent here, may have held at the fork.
        gc.disable()
        for signum in _SIGNALS:
            signal.signal(signum, signal.SIG_DFL)  # the job's SIGTERM ends the child at once
        os.close(readable)
        try:
            out = (True, fn(*args))
        except BaseException as err:  # raised in the parent
            out = (False, err)
        data = memoryview(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        while data:
            data = data[os.write(writable, data) :]
    finally:
        os._exit(0)  # nothing of the parent's exit runs twice


@contextmanager
def signal_blamed() -> Iterator[None]:
    """An error after a signal was caught is the signal's doing (a loader worker killed by
    the same SIGTERM): reported as the interruption it is, and the file marked so."""
    try:
        yield
    except Exception as err:  # Interrupted is no Exception: it passes as it is
        if not _caught:
            raise
        _Regions.raised = True
        try:
            stop_if_signalled()
        except Interrupted as stop:
            raise stop from err


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
