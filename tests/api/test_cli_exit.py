"""The CLI ends a successful run without the interpreter's module teardown
(hookrun/__main__.py: _leave_quickly), and still gives every exit handler, profiler and
log what the ordinary exit would."""

from __future__ import annotations

import os
import pstats
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from conftest import SEED_MLP, hookrun_cli

pytestmark = pytest.mark.slow  # every test here takes over ~1.5 s

# A model module of the user's that registers an exit handler (as wandb or a logger would)
# and starts a worker thread that is still writing when the run ends.
USER_MODULE = """
import atexit, os, threading, time
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        atexit.register(lambda: open(os.environ["MARKER"], "a").write("atexit ran\\n"))
        def late():
            time.sleep(1.5)
            open(os.environ["MARKER"], "a").write("thread finished\\n")
        threading.Thread(target=late).start()

    def forward(self, x):
        return self.fc(x)
"""

CUSTOM = [
    "model=custom",
    "model._target_=user_net.Net",
    "dataset=constant",
    "dataset.shape=[3]",
    "dataset.size=2",
    "render=false",
]


def _user_module(tmp_path: Path, monkeypatch, source: str) -> Path:
    """`source` importable as user_net for the CLI; the marker file its code writes."""
    (tmp_path / "user_net.py").write_text(source)
    paths = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("MARKER", str(tmp_path / "marker.txt"))
    return tmp_path / "marker.txt"


def test_exit_handlers_threads_and_the_log_are_honoured(tmp_path, monkeypatch):
    marker = _user_module(tmp_path, monkeypatch, USER_MODULE)
    run_dir = tmp_path / "run"
    proc = hookrun_cli([*CUSTOM, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # The live thread kept the ordinary exit, which waits for it; the handler ran after it.
    assert marker.read_text().splitlines() == ["thread finished", "atexit ran"]
    assert "time:" in (run_dir / "hookrun.log").read_text()  # the summary reached the log
    with h5py.File(run_dir / "captures.h5", "r") as f:
        assert f.attrs["status"] == "complete" and f.attrs["completed"] == 2


# A user's module that keeps a file open in a global and never closes it: only the
# ordinary exit's teardown flushes what it wrote.
OPEN_FILE_MODULE = """
import os
from torch import nn

LOG = open(os.environ["MARKER"], "w")

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        LOG.write("forward\\n")
        return self.fc(x)
"""


def test_a_user_module_keeps_the_ordinary_exit(tmp_path, monkeypatch):
    marker = _user_module(tmp_path, monkeypatch, OPEN_FILE_MODULE)
    proc = hookrun_cli([*CUSTOM, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text().count("forward\n") >= 2  # the probe's passes and the batch's


# QuickExit alone, in a fresh interpreter: made at start-up, then asked to leave.
LEAVE = """
import atexit, sys
from hookrun.quick_exit import QuickExit
quick = QuickExit()
if len(sys.argv) > 2:
    import user_module  # code that is not hookrun's: the ordinary exit is kept
atexit.register(lambda: open(sys.argv[1], "a").write("handler ran\\n"))
quick.leave()
print("returned to the ordinary exit", flush=True)
"""


def _leave(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "user_module.py").write_text("VALUE = 1\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", LEAVE, str(tmp_path / "marker.txt"), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_quick_exit_runs_the_exit_handlers_then_ends_at_once(tmp_path):
    proc = _leave(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "returned" not in proc.stdout  # it ended inside leave()
    assert (tmp_path / "marker.txt").read_text() == "handler ran\n"  # once


def test_quick_exit_returns_when_user_code_was_imported(tmp_path):
    proc = _leave(tmp_path, "with a user module")
    assert proc.returncode == 0, proc.stderr
    assert "returned to the ordinary exit" in proc.stdout
    assert (tmp_path / "marker.txt").read_text() == "handler ran\n"  # by the ordinary exit


def test_a_run_with_its_stdout_closed_still_succeeds(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SEED_MLP, "render=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        [sys.executable, "-m", "hookrun", *args],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.close(1),  # as cron or a daemon starts it: sys.stdout is None
    )
    assert proc.returncode == 0, proc.stderr
    with h5py.File(run_dir / "captures.h5", "r") as f:
        assert f.attrs["status"] == "complete"


def test_a_profiler_still_gets_its_report(tmp_path):
    """`python -m cProfile -o F -m hookrun`: the profile is written after the run returns,
    so a process that skipped straight to its end would lose it."""
    out = tmp_path / "run.prof"
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    args = [*SEED_MLP, "render=false", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(out), "-m", "hookrun", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert pstats.Stats(str(out)).total_calls > 0


# A language-model run in a fresh interpreter: what it imports (transformers, tokenizers,
# datasets for dataset=hf_disk, matplotlib for its picture) is hookrun's own.
LANGUAGE_RUN = """
import sys
from hookrun.quick_exit import QuickExit
quick = QuickExit()
import datasets
datasets.Dataset.from_dict({"text": ["the cat sat on the mat " * 8] * 4}).save_to_disk(sys.argv[2])
import hookrun
hookrun.run(["experiment=lm_cache", "dataset=hf_disk", "dataset.path=" + sys.argv[2],
             "dataset.context=16", "limit=2", "progress=false"], run_dir=sys.argv[1])
print("foreign:", quick.foreign(), flush=True)
"""


def test_a_language_model_run_imports_nothing_that_keeps_the_ordinary_exit(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", LANGUAGE_RUN, str(tmp_path / "run"), str(tmp_path / "ds")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "foreign: []" in proc.stdout, proc.stdout
    assert (tmp_path / "run" / "images" / "lm_cache" / "residual_norms.png").is_file()


def test_import_hookrun_loads_no_torchvision():
    """torchvision costs about 1 s to import: `import hookrun` (to read a file with
    hookrun.open, or to start a language-model run) leaves it to what needs it: an image
    dataset, a torchvision model, an image picture. (transformers' modeling code imports it
    itself where it is installed.)"""
    code = "import sys, hookrun\nprint('torchvision loaded:', 'torchvision' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torchvision loaded: False" in proc.stdout, proc.stdout


# An image run with a torchvision model in a fresh interpreter: torchvision's ops load
# torch._dynamo and torch._inductor, which import colorama where it is installed (it was
# the one foreign package, so a torchvision run's SIGTERM and success both paid the ordinary
# teardown: 4-5 s after "interrupted by SIGTERM" on two busy cores).
IMAGE_RUN = """
import sys
from hookrun.quick_exit import QuickExit
quick = QuickExit()
import hookrun
hookrun.run(["experiment=grad_cam", "model=mobilenet_v2", "dataset=fake", "dataset.size=1",
             "dataset.image_size=32", "progress=false"], run_dir=sys.argv[1])
print("foreign:", quick.foreign(), flush=True)
"""


def test_a_torchvision_run_imports_nothing_that_keeps_the_ordinary_exit(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", IMAGE_RUN, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "foreign: []" in proc.stdout, proc.stdout
