"""SIGTERM where no Python runs: inside a backward pass (one call into autograd's C++
engine), inside one long C call (ROAD's sparse solve). Slurm gives 30 s between SIGTERM and
SIGKILL, and a busy machine stretches either past that: the run must stop at once, in a
real process, and leave a file marked interrupted (that resumes to an uninterrupted run's
bytes)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import hook, read, run_config, spawn

from hookrun.errors import Interrupted
from hookrun.io.layout import open_readonly
from hookrun.runtime.hooks import run_mode
from hookrun.signals import interruptible, run_in_child, signals_caught
from hookrun.stages.derive.integrated import quadrature
from hookrun.stages.evaluate.impute import IN_CHILD_PIXELS, noisy_linear_imputation

# Far above what a run needs from SIGTERM to its exit once it stops where it is (on two busy
# cores: 0.5 s, or 2.5 s where a test's own model keeps the interpreter's teardown), far
# below what it waited before: a backward pass about five times as long as the six seconds
# its forward took to build (23 s there), a sparse factorisation of 57 s.
BOUND_S = 10


def _stalling(flag) -> list[str]:
    """TwiceNet over 6 rows in batches of 2, its second batch's backward pass long (while
    `flag` exists); the input's gradient captured, so that the backward reaches the input."""
    return [
        "model=custom",
        "model._target_=stall_models.BackwardStallNet",
        f"+model.kwargs.stall_flag={flag}",
        "dataset=constant",
        "dataset.shape=[4]",
        "dataset.size=6",
        "batch_size=2",
        *hook("c", "fc", "output", "capture"),
        *hook("g", "input", "grad_output", "capture"),
        "progress=false",
        "render=false",
    ]


def _sigterm_once_flag_goes(args: list[str], flag, cwd, run_dir, wait_s: float) -> str:
    """Start the run, SIGTERM it `wait_s` after it removed `flag`; its stderr, once it has
    ended within BOUND_S of the signal with exit status 143 (a failure otherwise)."""
    flag.touch()
    proc = spawn([*args, f"hydra.run.dir={run_dir}"], cwd)
    deadline = time.monotonic() + 120
    while flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not flag.exists() and proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(wait_s)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {BOUND_S} s after SIGTERM")
    assert time.monotonic() - sent < BOUND_S
    assert proc.returncode == 143, err[-2000:]
    return err


@pytest.mark.slow
def test_sigterm_inside_a_long_backward_ends_the_run_within_seconds_and_it_resumes(tmp_path):
    flag = tmp_path / "stall"
    args = _stalling(flag)
    run_dir = tmp_path / "run"
    path = run_dir / "captures.h5"
    # Half a second past the hook that removed the flag: no Python runs from there on.
    err = _sigterm_once_flag_goes(args, flag, tmp_path, run_dir, 0.5)
    lines = [x for x in err.splitlines() if x.startswith("hookrun: ")]
    assert lines == [
        f"hookrun: error: interrupted by SIGTERM: {path} holds 2 complete rows and is marked "
        "interrupted; continue it with resume=true"
    ], err[-2000:]
    with open_readonly(path) as f:
        assert f.attrs["status"] == "interrupted" and "SIGTERM" in f.attrs["error"]
        assert f.attrs["completed"] == 2  # the batch before it
    resumed = spawn([*args, f"hydra.run.dir={run_dir}", "resume=true"], tmp_path)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    clean = read(run_config(tmp_path / "clean", args).path)
    again = read(path)
    assert again.keys() == clean.keys()
    for key in clean:
        assert again[key].tobytes() == clean[key].tobytes(), key
    with h5py.File(path, "r") as f:
        assert f.attrs["status"] == "complete"


def _forks(pid: int) -> list[int]:
    """`pid`'s children that are forks of it (same command line): run_in_child's solver,
    not a helper some library runs with subprocess (on CI one ran at start-up, and the
    signal then stopped the run before its file was made)."""
    out = []
    try:
        own = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return out
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            if (stat.parent / "cmdline").read_bytes() == own:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


@pytest.mark.slow
def test_sigterm_inside_road_s_sparse_solve_ends_the_run_within_seconds(tmp_path):
    """ROAD's imputation of one 640 x 640 image with 90 % of it removed: one SuperLU
    factorisation, a C call that no signal handler can interrupt (57 s on two busy cores),
    solved in a child process that the signal kills, with the run. (Its resume is the same
    path as the backward's above, and ROAD's bytes after a kill are
    tests/evaluate/test_evaluation_runs.py's; a resume here would solve for minutes.)"""
    args = [
        "model=resnet18",
        "model.weights=null",
        "+model.kwargs.num_classes=2",
        "dataset=constant",
        "dataset.shape=[3,640,640]",
        "dataset.size=1",
        *hook("g", "input", "grad_output", "capture"),
        "evaluate=faithfulness",
        "evaluate.metrics=[road]",
        "evaluate.road.fractions=[0.9]",
        "progress=false",
        "render=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = spawn(args, tmp_path)
    deadline = time.monotonic() + 180
    while not (solver := _forks(proc.pid)) and proc.poll() is None:
        assert time.monotonic() < deadline, "no solve in a child process after 180 s"
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {BOUND_S} s after SIGTERM")
    assert time.monotonic() - sent < BOUND_S
    assert proc.returncode == 143, err[-2000:]
    assert "interrupted by SIGTERM" in err
    assert not Path(f"/proc/{solver[0]}").exists()  # killed and reaped, not left solving
    with open_readonly(tmp_path / "run" / "captures.h5") as f:
        assert f.attrs["status"] == "interrupted" and f.attrs["completed"] == 0


def test_road_s_solves_in_a_child_give_the_same_bytes():
    """The solves of a forward pass's images in a child process (signals.run_in_child)
    are the solves made here, bit for bit; an error there is raised here."""
    generator = torch.Generator().manual_seed(3)
    images = torch.rand(3, 3, 100, 100, generator=generator)
    removed = torch.rand(3, 100, 100, generator=generator) < 0.8
    draws = torch.randn(images.shape, generator=generator)
    assert int(removed.sum()) >= IN_CHILD_PIXELS  # the child's path
    here = noisy_linear_imputation(images, removed, 0.01, draws)  # outside interruptible work
    with signals_caught(), interruptible():
        there = noisy_linear_imputation(images, removed, 0.01, draws)
        with pytest.raises(ZeroDivisionError):
            run_in_child(lambda: 1 / 0)
    assert here.numpy().tobytes() == there.numpy().tobytes()


_SIGNAL_AT_FORK: dict[str, int] = {}  # which at-fork hook sends which signal


def _hook(when: str) -> Callable[[], None]:
    def send() -> None:
        if signum := _SIGNAL_AT_FORK.pop(when, None):
            os.kill(os.getpid(), signum)

    return send


# Registered once (os.register_at_fork has no undo), inert while nothing is queued.
os.register_at_fork(before=_hook("before"), after_in_parent=_hook("after_in_parent"))


@pytest.mark.parametrize("when", ["before", "after_in_parent"])
def test_a_signal_during_run_in_child_s_fork_stops_the_run_and_its_child(when):
    """A SIGTERM whose handler runs while os.fork runs its hooks, where CPython prints what
    a hook raises and drops it (in CI it left logging's lock held, and the run hung), is
    acted on once the fork is done: Interrupted at once, the child killed, logging's lock
    free."""
    with signals_caught(), interruptible():
        _SIGNAL_AT_FORK[when] = signal.SIGTERM
        started = time.monotonic()
        with pytest.raises(Interrupted):
            run_in_child(time.sleep, 20)
        assert time.monotonic() - started < BOUND_S
    assert not _SIGNAL_AT_FORK
    assert logging._lock.acquire(timeout=1)
    logging._lock.release()


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).tanh()


def test_the_checks_leave_no_hook_and_change_no_gradient():
    """run_mode's checks come off with it (on every exit), a pass without gradients walks
    no graph, and a gradient through checked nodes is the unchecked one."""
    model = _Chain()
    x = torch.randn(2, 3, requires_grad=True)
    (plain,) = torch.autograd.grad(model(x).sum(), x)
    with run_mode(model):
        assert model._forward_hooks  # the check's root hook
        with torch.no_grad():
            assert model(x).grad_fn is None
        out = model(x)
        assert "hookrun.signal_check" in out.grad_fn.metadata
        (checked,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(plain, checked)
    with pytest.raises(RuntimeError), run_mode(model):
        raise RuntimeError("boom")
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


@pytest.mark.parametrize("steps", [*range(1, 40), 50, 128, 1000])
def test_gauss_legendre_nodes_are_numpys_bit_for_bit(steps):
    """The quadrature no longer solves a dense eigenproblem (36 s for 4000 steps on two
    busy cores, one C call no signal stops); its nodes and weights are numpy's leggauss's
    to the last bit, so every integrated-gradients file keeps its bytes."""
    alphas, weights = quadrature("gausslegendre", steps)
    x, w = np.polynomial.legendre.leggauss(steps)
    assert alphas.numpy().tobytes() == (0.5 * (1 + x)).tobytes()
    assert weights.numpy().tobytes() == (0.5 * w).tobytes()
